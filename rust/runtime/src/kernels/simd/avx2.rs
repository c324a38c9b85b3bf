//! [`Simd`] on AVX2 and FMA: 8 lanes, masks as vectors of all-ones or all-zeros lanes.

use std::arch::x86_64::*;

use super::Simd;

/// AVX2 with FMA (Haswell and later, Zen 1 and later).
#[derive(Clone, Copy)]
pub struct Avx2;

/// Eight all-ones lanes then eight zeros: the 8 lanes from `8 - n` are the first `n` set.
static FIRST: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

/// `2^n` for integral `n` in [-126, 127], built from its exponent bits.
#[inline(always)]
unsafe fn pow2(n: __m256i) -> __m256 {
    // SAFETY: register arithmetic; the caller enabled AVX2.
    unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n, _mm256_set1_epi32(127)))) }
}

// SAFETY: every method below is a few AVX2 or FMA instructions on registers, or a load or
// store of the lanes the trait's contract says are accessible (`vmaskmovps` neither reads
// nor faults on the lanes it leaves out); callers enable AVX2 and FMA.
unsafe impl Simd for Avx2 {
    const LANES: usize = 8;
    const REGISTERS: usize = 16;
    type V = __m256;
    type M = __m256;
    type I = __m256i;

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn first(n: usize) -> __m256 {
        // SAFETY: 8 - min(n, 8) is in [0, 8], so the 8 lanes read lie in `FIRST`.
        unsafe { _mm256_castsi256_ps(_mm256_loadu_si256(FIRST.as_ptr().add(8 - n.min(8)).cast())) }
    }
    #[inline(always)]
    unsafe fn load_masked(m: __m256, p: *const f32) -> __m256 {
        // `vmaskmovps` is slow on AMD's cores (a store is microcoded on Zen 3: 1x1
        // convolutions ran 10-25% faster with plain moves for full masks), and most masks
        // are full; a tile's masks are fixed for its loop, so the test is hoisted.
        unsafe {
            if _mm256_movemask_ps(m) == 0xFF {
                _mm256_loadu_ps(p)
            } else {
                _mm256_maskload_ps(p, _mm256_castps_si256(m))
            }
        }
    }
    #[inline(always)]
    unsafe fn store_masked(p: *mut f32, m: __m256, v: __m256) {
        unsafe {
            if _mm256_movemask_ps(m) == 0xFF {
                _mm256_storeu_ps(p, v)
            } else {
                _mm256_maskstore_ps(p, _mm256_castps_si256(m), v)
            }
        }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn div(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn fnma(a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fnmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn abs(a: __m256) -> __m256 {
        unsafe { _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX))) }
    }
    #[inline(always)]
    unsafe fn round(a: __m256) -> __m256 {
        unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a) }
    }
    #[inline(always)]
    unsafe fn scale2(a: __m256, n: __m256) -> __m256 {
        // 2^n as 2^(n >> 1) 2^(n - (n >> 1)): both halves in [-75, 64], inside the exponent's
        // range, so only the last product rounds (to a subnormal, zero or infinity).
        unsafe {
            let n = _mm256_cvtps_epi32(n);
            let half = _mm256_srai_epi32::<1>(n);
            _mm256_mul_ps(_mm256_mul_ps(a, pow2(half)), pow2(_mm256_sub_epi32(n, half)))
        }
    }
    #[inline(always)]
    unsafe fn lt(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_cmp_ps::<_CMP_LT_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn gt(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_cmp_ps::<_CMP_GT_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn eq(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_cmp_ps::<_CMP_EQ_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn ne(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_cmp_ps::<_CMP_NEQ_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn nan(a: __m256) -> __m256 {
        unsafe { _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a) }
    }
    #[inline(always)]
    unsafe fn and(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_and_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn or(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_or_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn any(m: __m256) -> bool {
        unsafe { _mm256_movemask_ps(m) != 0 }
    }
    #[inline(always)]
    unsafe fn select(m: __m256, yes: __m256, no: __m256) -> __m256 {
        unsafe { _mm256_blendv_ps(no, yes, m) }
    }
    #[inline(always)]
    unsafe fn reduce_max(a: __m256) -> f32 {
        unsafe {
            let m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
        }
    }
    #[inline(always)]
    unsafe fn reduce_add(a: __m256) -> f32 {
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
        }
    }
    #[inline(always)]
    unsafe fn izero() -> __m256i {
        unsafe { _mm256_setzero_si256() }
    }
    #[inline(always)]
    unsafe fn load_pairs(p: *const u32) -> __m256i {
        unsafe { _mm256_loadu_si256(p.cast()) }
    }
    #[inline(always)]
    unsafe fn load_byte_pairs(p: *const u16) -> __m256i {
        unsafe { _mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn splat_pair(pair: u32) -> __m256i {
        unsafe { _mm256_set1_epi32(pair as i32) }
    }
    #[inline(always)]
    unsafe fn dot_pairs(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)) }
    }
    #[inline(always)]
    unsafe fn to_float(a: __m256i) -> __m256 {
        unsafe { _mm256_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn bits(a: __m256i) -> __m256 {
        unsafe { _mm256_castsi256_ps(a) }
    }
    #[inline(always)]
    unsafe fn store_i16(p: *mut i16, a: __m256) {
        unsafe {
            // Pack to int16 within each 128-bit half, then gather the halves' low quarters.
            let i = _mm256_cvtps_epi32(a);
            let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packs_epi32(i, i));
            _mm_storeu_si128(p.cast(), _mm256_castsi256_si128(packed))
        }
    }
    #[inline(always)]
    unsafe fn store_u8(p: *mut u8, a: __m256) {
        unsafe {
            // Pack to bytes within each 128-bit half (lanes 0-3 and 4-7 in each half's first
            // four bytes), then join the halves' first words.
            let i = _mm256_cvtps_epi32(a);
            let bytes = _mm256_packus_epi16(_mm256_packus_epi32(i, i), _mm256_setzero_si256());
            let both = _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256::<1>(bytes));
            _mm_storel_epi64(p.cast(), both)
        }
    }
    #[inline(always)]
    unsafe fn dot_bf16(acc: __m256, a: __m256i, b: __m256i) -> __m256 {
        unsafe {
            let high = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
            let lo = |x: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(x));
            let hi = |x: __m256i| _mm256_castsi256_ps(_mm256_and_si256(x, high));
            _mm256_fmadd_ps(hi(a), hi(b), _mm256_fmadd_ps(lo(a), lo(b), acc))
        }
    }
}
