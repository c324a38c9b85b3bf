//! [`Simd`] on AVX-512F: 16 lanes, masks in mask registers.

use std::arch::x86_64::*;

use super::Simd;

/// AVX-512F (Skylake-SP and later, Zen 4 and later).
#[derive(Clone, Copy)]
pub struct Avx512;

// SAFETY: every method below is one or two AVX-512F or AVX-512BW instructions on registers, or
// a load or store of the lanes the trait's contract says are accessible; callers enable both.
unsafe impl Simd for Avx512 {
    const LANES: usize = 16;
    const REGISTERS: usize = 32;
    type V = __m512;
    type M = __mmask16;
    type I = __m512i;

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn first(n: usize) -> __mmask16 {
        ((1u32 << n.min(16)) - 1) as u16
    }
    #[inline(always)]
    unsafe fn load_masked(m: __mmask16, p: *const f32) -> __m512 {
        unsafe { _mm512_maskz_loadu_ps(m, p) }
    }
    #[inline(always)]
    unsafe fn store_masked(p: *mut f32, m: __mmask16, v: __m512) {
        unsafe { _mm512_mask_storeu_ps(p, m, v) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn div(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn fnma(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fnmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn abs(a: __m512) -> __m512 {
        unsafe { _mm512_abs_ps(a) }
    }
    #[inline(always)]
    unsafe fn round(a: __m512) -> __m512 {
        unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a) }
    }
    #[inline(always)]
    unsafe fn scale2(a: __m512, n: __m512) -> __m512 {
        unsafe { _mm512_scalef_ps(a, n) }
    }
    #[inline(always)]
    unsafe fn lt(a: __m512, b: __m512) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn gt(a: __m512, b: __m512) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn eq(a: __m512, b: __m512) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn ne(a: __m512, b: __m512) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn nan(a: __m512) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, a) }
    }
    #[inline(always)]
    unsafe fn and(a: __mmask16, b: __mmask16) -> __mmask16 {
        a & b
    }
    #[inline(always)]
    unsafe fn or(a: __mmask16, b: __mmask16) -> __mmask16 {
        a | b
    }
    #[inline(always)]
    unsafe fn any(m: __mmask16) -> bool {
        m != 0
    }
    #[inline(always)]
    unsafe fn select(m: __mmask16, yes: __m512, no: __m512) -> __m512 {
        unsafe { _mm512_mask_blend_ps(m, no, yes) }
    }
    #[inline(always)]
    unsafe fn reduce_max(a: __m512) -> f32 {
        unsafe { _mm512_reduce_max_ps(a) }
    }
    #[inline(always)]
    unsafe fn reduce_add(a: __m512) -> f32 {
        unsafe { _mm512_reduce_add_ps(a) }
    }
    #[inline(always)]
    unsafe fn izero() -> __m512i {
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    unsafe fn load_pairs(p: *const u32) -> __m512i {
        unsafe { _mm512_loadu_si512(p.cast()) }
    }
    #[inline(always)]
    unsafe fn load_byte_pairs(p: *const u16) -> __m512i {
        // `vpmovsxbw` to 512 bits is AVX512-BW's, as `dot_pairs`'s `vpmaddwd`.
        unsafe { _mm512_cvtepi8_epi16(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn splat_pair(pair: u32) -> __m512i {
        unsafe { _mm512_set1_epi32(pair as i32) }
    }
    #[inline(always)]
    unsafe fn dot_pairs(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        // `vpmaddwd` on 512 bits is AVX512-BW's, which the family requires (`super::super::isa`).
        unsafe { _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)) }
    }
    #[inline(always)]
    unsafe fn to_float(a: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn bits(a: __m512i) -> __m512 {
        unsafe { _mm512_castsi512_ps(a) }
    }
    #[inline(always)]
    unsafe fn store_i16(p: *mut i16, a: __m512) {
        unsafe { _mm256_storeu_si256(p.cast(), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(a))) }
    }
    #[inline(always)]
    unsafe fn store_u8(p: *mut u8, a: __m512) {
        unsafe { _mm_storeu_si128(p.cast(), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a))) }
    }
    #[inline(always)]
    unsafe fn store_u8x4(p: *mut u8, [a, b, c, d]: [__m512; 4]) {
        // Packs within each 128-bit lane (dwords 0-3 of each lane from a, b, c, d in turn),
        // then one permute into order and one store: `vpmovdb` to memory, four a call, took
        // most of a quantization's time on a Zen 4.
        unsafe {
            let (a, b, c, d) =
                (_mm512_cvtps_epi32(a), _mm512_cvtps_epi32(b), _mm512_cvtps_epi32(c), _mm512_cvtps_epi32(d));
            let bytes = _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
            let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
            _mm512_storeu_si512(p.cast(), _mm512_permutexvar_epi32(order, bytes))
        }
    }
    #[inline(always)]
    unsafe fn dot_bf16(acc: __m512, a: __m512i, b: __m512i) -> __m512 {
        unsafe {
            let high = _mm512_set1_epi32(0xFFFF_0000_u32 as i32);
            let lo = |x: __m512i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(x));
            let hi = |x: __m512i| _mm512_castsi512_ps(_mm512_and_si512(x, high));
            _mm512_fmadd_ps(hi(a), hi(b), _mm512_fmadd_ps(lo(a), lo(b), acc))
        }
    }
}
