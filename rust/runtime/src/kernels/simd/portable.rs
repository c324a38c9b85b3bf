//! [`Simd`] in plain Rust: 8 lanes as arrays, each operation a loop the compiler vectorizes
//! for whatever the target has. It keeps every kernel building and correct on any CPU; it is
//! not tuned (`super::super::isa` runs torch's kernels instead unless forced).

use super::Simd;

/// Any target.
#[derive(Clone, Copy)]
pub struct Portable;

const L: usize = 8;

#[inline(always)]
fn map(a: [f32; L], f: impl Fn(f32) -> f32) -> [f32; L] {
    a.map(f)
}

#[inline(always)]
fn zip(a: [f32; L], b: [f32; L], f: impl Fn(f32, f32) -> f32) -> [f32; L] {
    std::array::from_fn(|i| f(a[i], b[i]))
}

#[inline(always)]
fn test(a: [f32; L], b: [f32; L], f: impl Fn(f32, f32) -> bool) -> [bool; L] {
    std::array::from_fn(|i| f(a[i], b[i]))
}

/// `2^n` for integral `n` in [-126, 127], built from its exponent bits.
#[inline(always)]
fn pow2(n: i32) -> f32 {
    f32::from_bits(((n + 127) as u32) << 23)
}

// SAFETY: the methods are plain Rust; the pointer ones read or write exactly the lanes the
// trait's contract says are accessible.
unsafe impl Simd for Portable {
    const LANES: usize = L;
    const REGISTERS: usize = 16;
    type V = [f32; L];
    type M = [bool; L];
    type I = [i32; L];

    #[inline(always)]
    unsafe fn zero() -> [f32; L] {
        [0.0; L]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> [f32; L] {
        [x; L]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; L] {
        // SAFETY: `L` floats from `p` are readable (the caller's).
        unsafe { p.cast::<[f32; L]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; L]) {
        // SAFETY: `L` floats from `p` are writable (the caller's).
        unsafe { p.cast::<[f32; L]>().write_unaligned(v) }
    }
    #[inline(always)]
    unsafe fn first(n: usize) -> [bool; L] {
        std::array::from_fn(|i| i < n)
    }
    #[inline(always)]
    unsafe fn load_masked(m: [bool; L], p: *const f32) -> [f32; L] {
        // SAFETY: the selected lanes are readable (the caller's); no other is read.
        std::array::from_fn(|i| if m[i] { unsafe { *p.add(i) } } else { 0.0 })
    }
    #[inline(always)]
    unsafe fn store_masked(p: *mut f32, m: [bool; L], v: [f32; L]) {
        for i in 0..L {
            if m[i] {
                // SAFETY: the selected lanes are writable (the caller's).
                unsafe { *p.add(i) = v[i] };
            }
        }
    }
    #[inline(always)]
    unsafe fn add(a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |a, b| a + b)
    }
    #[inline(always)]
    unsafe fn sub(a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |a, b| a - b)
    }
    #[inline(always)]
    unsafe fn mul(a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |a, b| a * b)
    }
    #[inline(always)]
    unsafe fn div(a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |a, b| a / b)
    }
    #[inline(always)]
    unsafe fn fma(a: [f32; L], b: [f32; L], c: [f32; L]) -> [f32; L] {
        // Unfused: `mul_add` is a library call on a target without FMA.
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn fnma(a: [f32; L], b: [f32; L], c: [f32; L]) -> [f32; L] {
        std::array::from_fn(|i| c[i] - a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn max(a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |a, b| if a > b { a } else { b })
    }
    #[inline(always)]
    unsafe fn min(a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |a, b| if a < b { a } else { b })
    }
    #[inline(always)]
    unsafe fn abs(a: [f32; L]) -> [f32; L] {
        map(a, f32::abs)
    }
    #[inline(always)]
    unsafe fn round(a: [f32; L]) -> [f32; L] {
        map(a, f32::round_ties_even)
    }
    #[inline(always)]
    unsafe fn scale2(a: [f32; L], n: [f32; L]) -> [f32; L] {
        // As `Avx2`'s: two factors inside the exponent's range, one rounding.
        zip(a, n, |a, n| {
            let n = n as i32;
            a * pow2(n >> 1) * pow2(n - (n >> 1))
        })
    }
    #[inline(always)]
    unsafe fn lt(a: [f32; L], b: [f32; L]) -> [bool; L] {
        test(a, b, |a, b| a < b)
    }
    #[inline(always)]
    unsafe fn gt(a: [f32; L], b: [f32; L]) -> [bool; L] {
        test(a, b, |a, b| a > b)
    }
    #[inline(always)]
    unsafe fn eq(a: [f32; L], b: [f32; L]) -> [bool; L] {
        test(a, b, |a, b| a == b)
    }
    #[inline(always)]
    unsafe fn ne(a: [f32; L], b: [f32; L]) -> [bool; L] {
        test(a, b, |a, b| a != b && !a.is_nan() && !b.is_nan())
    }
    #[inline(always)]
    unsafe fn nan(a: [f32; L]) -> [bool; L] {
        a.map(f32::is_nan)
    }
    #[inline(always)]
    unsafe fn and(a: [bool; L], b: [bool; L]) -> [bool; L] {
        std::array::from_fn(|i| a[i] & b[i])
    }
    #[inline(always)]
    unsafe fn or(a: [bool; L], b: [bool; L]) -> [bool; L] {
        std::array::from_fn(|i| a[i] | b[i])
    }
    #[inline(always)]
    unsafe fn any(m: [bool; L]) -> bool {
        m.iter().any(|&b| b)
    }
    #[inline(always)]
    unsafe fn select(m: [bool; L], yes: [f32; L], no: [f32; L]) -> [f32; L] {
        std::array::from_fn(|i| if m[i] { yes[i] } else { no[i] })
    }
    #[inline(always)]
    unsafe fn reduce_max(a: [f32; L]) -> f32 {
        a.into_iter().fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
    }
    #[inline(always)]
    unsafe fn reduce_add(a: [f32; L]) -> f32 {
        a.into_iter().sum()
    }
    #[inline(always)]
    unsafe fn izero() -> [i32; L] {
        [0; L]
    }
    #[inline(always)]
    unsafe fn load_pairs(p: *const u32) -> [i32; L] {
        // SAFETY: `L` values from `p` are readable (the caller's).
        unsafe { p.cast::<[i32; L]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn load_byte_pairs(p: *const u16) -> [i32; L] {
        // SAFETY: `2 * L` bytes from `p` are readable (the caller's).
        let b = unsafe { p.cast::<[[i8; 2]; L]>().read_unaligned() };
        b.map(|[lo, hi]| ((hi as i16 as u16 as u32) << 16 | lo as i16 as u16 as u32) as i32)
    }
    #[inline(always)]
    unsafe fn splat_pair(pair: u32) -> [i32; L] {
        [pair as i32; L]
    }
    #[inline(always)]
    unsafe fn dot_pairs(acc: [i32; L], a: [i32; L], b: [i32; L]) -> [i32; L] {
        let (lo, hi) = (|v: i32| v as i16 as i32, |v: i32| v >> 16);
        std::array::from_fn(|i| {
            acc[i].wrapping_add(lo(a[i]).wrapping_mul(lo(b[i])).wrapping_add(hi(a[i]).wrapping_mul(hi(b[i]))))
        })
    }
    #[inline(always)]
    unsafe fn to_float(a: [i32; L]) -> [f32; L] {
        a.map(|v| v as f32)
    }
    #[inline(always)]
    unsafe fn bits(a: [i32; L]) -> [f32; L] {
        a.map(|v| f32::from_bits(v as u32))
    }
    #[inline(always)]
    unsafe fn store_i16(p: *mut i16, a: [f32; L]) {
        // SAFETY: `L` int16s from `p` are writable (the caller's).
        unsafe { p.cast::<[i16; L]>().write_unaligned(a.map(|v| v as i16)) }
    }
    #[inline(always)]
    unsafe fn store_u8(p: *mut u8, a: [f32; L]) {
        // SAFETY: `L` bytes from `p` are writable (the caller's).
        unsafe { p.cast::<[u8; L]>().write_unaligned(a.map(|v| v as u8)) }
    }
    #[inline(always)]
    unsafe fn dot_bf16(acc: [f32; L], a: [i32; L], b: [i32; L]) -> [f32; L] {
        let (lo, hi) = (|v: i32| f32::from_bits((v as u32) << 16), |v: i32| f32::from_bits(v as u32 & 0xFFFF_0000));
        // Unfused, as `fma` is here.
        std::array::from_fn(|i| hi(a[i]) * hi(b[i]) + (lo(a[i]) * lo(b[i]) + acc[i]))
    }
}
