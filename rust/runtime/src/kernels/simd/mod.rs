//! The vector operations kwexport's kernels are written in, one implementation per
//! instruction set: [`avx512::Avx512`] (16 lanes), [`avx2::Avx2`] (AVX2 and FMA, 8 lanes) and
//! [`portable::Portable`] (8 lanes of plain Rust, for any target). A kernel is generic over
//! [`Simd`] and written once; `super::isa` instantiates it per instruction set inside a
//! function that enables that set's features, so every operation below inlines to its
//! instructions.

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod portable;

/// A vector of `LANES` float32 lanes, the lane masks its comparisons give, and the vector of
/// `LANES` int32 sums of 16-bit pairs that the int8 GEMM accumulates in (`super::int8`).
///
/// # Safety
/// Every method may use its instruction set's instructions: it may be called only from a
/// function that enabled them (`super::isa`'s entries do) on a CPU that has them. Methods
/// that take pointers read or write `LANES` floats from there, or, for the masked ones, the
/// lanes the mask selects only (the others are neither read nor written).
pub unsafe trait Simd: Copy + 'static {
    /// Lanes per vector.
    const LANES: usize;
    /// Vector registers the instruction set has, which sizes the GEMM's register tiles.
    const REGISTERS: usize;
    /// A vector.
    type V: Copy;
    /// A mask of lanes.
    type M: Copy;
    /// `LANES` int32 lanes; as an operand of [`Simd::dot_pairs`], each lane a pair of int16
    /// (low half first).
    type I: Copy;

    /// # Safety
    /// See the trait.
    unsafe fn zero() -> Self::V;
    /// # Safety
    /// See the trait.
    unsafe fn splat(x: f32) -> Self::V;
    /// # Safety
    /// `LANES` floats from `p` are readable; see the trait.
    unsafe fn load(p: *const f32) -> Self::V;
    /// # Safety
    /// `LANES` floats from `p` are writable; see the trait.
    unsafe fn store(p: *mut f32, v: Self::V);
    /// The first `n` lanes (all of them from `LANES` on).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn first(n: usize) -> Self::M;
    /// The lanes `m` selects from `p`, zero in the others.
    ///
    /// # Safety
    /// The selected lanes from `p` are readable; see the trait.
    unsafe fn load_masked(m: Self::M, p: *const f32) -> Self::V;
    /// # Safety
    /// The selected lanes from `p` are writable; see the trait.
    unsafe fn store_masked(p: *mut f32, m: Self::M, v: Self::V);

    /// # Safety
    /// See the trait.
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// # Safety
    /// See the trait.
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    /// # Safety
    /// See the trait.
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// # Safety
    /// See the trait.
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c` (fused where the instruction set has it).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `c - a * b` (fused where the instruction set has it).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn fnma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// The larger of each pair, `b` where either is NaN (x86's `maxps`): a value clamped
    /// goes second, so that a NaN passes through as through torch's `clamp`.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// The smaller of each pair, `b` where either is NaN (see [`Simd::max`]).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V;
    /// # Safety
    /// See the trait.
    unsafe fn abs(a: Self::V) -> Self::V;
    /// Each lane rounded to the nearest integer, ties to even.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn round(a: Self::V) -> Self::V;
    /// `a * 2^n` for integral `n` in [-150, 128], rounded once as float32 rounds.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn scale2(a: Self::V, n: Self::V) -> Self::V;

    /// Lanes where `a < b` (false where either is NaN).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn lt(a: Self::V, b: Self::V) -> Self::M;
    /// Lanes where `a > b` (false where either is NaN).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn gt(a: Self::V, b: Self::V) -> Self::M;
    /// Lanes where `a == b` (false where either is NaN).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn eq(a: Self::V, b: Self::V) -> Self::M;
    /// Lanes where `a != b` and neither is NaN.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn ne(a: Self::V, b: Self::V) -> Self::M;
    /// Lanes where `a` is NaN.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn nan(a: Self::V) -> Self::M;
    /// # Safety
    /// See the trait.
    unsafe fn and(a: Self::M, b: Self::M) -> Self::M;
    /// # Safety
    /// See the trait.
    unsafe fn or(a: Self::M, b: Self::M) -> Self::M;
    /// Whether any lane is set.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn any(m: Self::M) -> bool;
    /// `yes` in the lanes `m` sets, `no` in the others.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn select(m: Self::M, yes: Self::V, no: Self::V) -> Self::V;
    /// # Safety
    /// See the trait.
    unsafe fn reduce_max(a: Self::V) -> f32;
    /// # Safety
    /// See the trait.
    unsafe fn reduce_add(a: Self::V) -> f32;

    /// # Safety
    /// See the trait.
    unsafe fn izero() -> Self::I;
    /// `LANES` pairs of int16 from `p`, each pair one `u32` (low half first).
    ///
    /// # Safety
    /// `LANES` values from `p` are readable; see the trait.
    unsafe fn load_pairs(p: *const u32) -> Self::I;
    /// `LANES` pairs of int8 from `p` (two bytes each, the first in memory the low half),
    /// each byte sign-extended to the int16 half [`Simd::load_pairs`] would read: the int8
    /// GEMM's weight, stored at a byte per value.
    ///
    /// # Safety
    /// `2 * LANES` bytes from `p` are readable; see the trait.
    unsafe fn load_byte_pairs(p: *const u16) -> Self::I;
    /// `pair` in every lane.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn splat_pair(pair: u32) -> Self::I;
    /// `acc + a.lo * b.lo + a.hi * b.hi` in each lane, the halves signed 16-bit: exact while
    /// the sums fit int32 (`vpmaddwd`'s one saturating case, all four halves -32768, is no
    /// value the int8 GEMM's operands take).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn dot_pairs(acc: Self::I, a: Self::I, b: Self::I) -> Self::I;
    /// Each int32 lane as float32 (rounded to nearest).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn to_float(a: Self::I) -> Self::V;
    /// Each int32 lane's bits as a float32 lane, unchanged (a GEMM that stores exact int32
    /// sums through the float32 output, `super::gemm::Words`).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn bits(a: Self::I) -> Self::V;
    /// Stores each lane, an integer within int16's range (as [`Simd::round`] leaves it), as
    /// an int16 at `p`.
    ///
    /// # Safety
    /// `LANES` int16s from `p` are writable; see the trait.
    unsafe fn store_i16(p: *mut i16, a: Self::V);
    /// Stores each lane, an integer within `[0, 255]` (as [`Simd::round`] leaves it), as a
    /// byte at `p`.
    ///
    /// # Safety
    /// `LANES` bytes from `p` are writable; see the trait.
    unsafe fn store_u8(p: *mut u8, a: Self::V);
    /// [`Simd::store_u8`] of four vectors, one after another from `p`.
    ///
    /// # Safety
    /// `4 * LANES` bytes from `p` are writable; see the trait.
    #[inline(always)]
    unsafe fn store_u8x4(p: *mut u8, [a, b, c, d]: [Self::V; 4]) {
        // SAFETY: the caller's.
        unsafe {
            Self::store_u8(p, a);
            Self::store_u8(p.add(Self::LANES), b);
            Self::store_u8(p.add(2 * Self::LANES), c);
            Self::store_u8(p.add(3 * Self::LANES), d);
        }
    }
    /// `acc + a.lo * b.lo + a.hi * b.hi` in each lane, the halves of each pair bfloat16 (each
    /// widened exactly to float32; two fused multiply-adds, the low half first).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn dot_bf16(acc: Self::V, a: Self::I, b: Self::I) -> Self::V;
}
