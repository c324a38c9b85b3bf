//! AMX's int8 tiles for the quad layout (`super::Layout::Quads`): `tdpbusd` sums 16 × 16
//! int32 lanes of 64 byte products each per instruction, where AVX512-VNNI's `vpdpbusd` sums
//! 16 lanes of 4. A block of the GEMM driver (`gemm::Block`, the weight's 64-column panel)
//! runs 16 rows at a time: their quantized words gathered into one zero-padded tile row each
//! (so that a dense row or a convolution's taps read alike, and `k` past a multiple of 64
//! bytes multiplies zeros), four accumulator tiles of 16 columns, the panel's rows read as
//! tiles in place (a panel row is 64 words, so a tile's 16 columns are 64 bytes of each 256),
//! then the sums finished as the vector kernels finish theirs.
//!
//! Linux hands AMX's 8 KB of tile state to a process only once asked (`arch_prctl`), which
//! `super::super::isa::int8_tiles` does once; the kernel is chosen there only where that
//! succeeded on a CPU with AMX-INT8 and AVX512-VNNI.

use std::arch::asm;
use std::arch::x86_64::*;

use super::super::activation::{apply, epilogue_slice, Epilogue};
use super::super::gemm::{self, Dot, Out, Pairs, Rows, Shape, Source};
use super::super::simd::{avx512::Avx512, Simd};
use super::super::PANEL;

/// A tile's rows, and 32-bit words per row (64 bytes: 16 quads of `k`).
const TILE: usize = 16;

/// The fewest rows and words of `k` a block runs on the tiles; smaller ones run on
/// AVX512-VNNI's kernel. Each 16 rows cost about 1000 cycles besides their products (the
/// gather into tile rows, the sums stored and read back): on a Xeon (Emerald Rapids, one
/// thread) `[784, 32] x [32, 128]` took 78 µs on the tiles against 38 on VNNI, `[784,
/// 256] x [256, 128]` 119 against 122, `[128, 768] x [768, 768]` 166 against 237, and 32
/// rows at `k = 256` 35 against 30.
const MIN_ROWS: usize = 64;
const MIN_WORDS: usize = 96;

/// `ldtilecfg`'s 64 bytes: palette 1; tiles 0–3 the sums (16 rows of 16 int32), 4 the rows'
/// bytes, 5 and 6 the panel's (16 rows of 64 bytes each).
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl Config {
    fn tiles() -> Config {
        let mut c = Config { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for t in 0..7 {
            c.colsb[t] = 64;
            c.rows[t] = TILE as u8;
        }
        c
    }
}

/// The GEMM driver's block on AMX (see [`super::super::gemm::block`]): rows `range` of
/// `source` times the panel of columns from `j`, `k` words deep; GELU over the results after
/// the tiles, the other epilogues as the sums are stored.
///
/// # Safety
/// `super::super::isa::int8_tiles`; the rows, the block's columns and its panel exist (the driver's contract).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
pub(in super::super) unsafe fn block(
    source: Source<u32>,
    range: std::ops::Range<usize>,
    s: &Shape,
    panels: &[u32],
    op: Out,
    j: usize,
    k: usize,
) {
    if range.len() < MIN_ROWS || k < MIN_WORDS {
        // SAFETY: the caller's; AVX512-VNNI is enabled above (every AMX CPU has it).
        return unsafe { gemm::block::<Avx512, super::Vnni>(source, range, s, panels, op, j, k) };
    }
    let gelu = matches!(s.epilogue, Epilogue::Gelu | Epilogue::GeluTanh);
    let tiles = if gelu { Shape { epilogue: Epilogue::None, requant: None, ..*s } } else { *s };
    // SAFETY (all below): as the caller guarantees.
    unsafe {
        match source {
            Source::Dense(d) => columns(d, range.clone(), &tiles, panels, op.0, j, k),
            Source::Table(t) => columns(t, range.clone(), &tiles, panels, op.0, j, k),
        }
        if gelu {
            let width = (s.n - j).min(PANEL);
            for r in range {
                // This row's part of the block, written above and by no other thread.
                let row = std::slice::from_raw_parts_mut(op.0.add(r * s.ldo + j), width);
                epilogue_slice::<Avx512>(s.epilogue, row);
                if let Some(q) = &s.requant {
                    q.apply_slice::<Avx512>(row);
                }
            }
        }
    }
}

/// Rows `range` times the 64 columns from `j`, 16 rows at a time.
#[inline(always)]
unsafe fn columns<R: Rows<u32>>(
    rows_of: R,
    range: std::ops::Range<usize>,
    s: &Shape,
    panels: &[u32],
    out: *mut f32,
    j: usize,
    k: usize,
) {
    // Each row's words padded to whole tile rows with zeros, which the panel's rows past `k`
    // (another panel's, or `tail`'s zeros) multiply.
    let depth = k.next_multiple_of(TILE);
    let mut a = vec![0u32; TILE * depth];
    let panel = &panels[j / PANEL * k * PANEL..][..k * PANEL];
    // The panel's last tile of rows where `k` ends inside it, padded with zero rows: a tile
    // read past the panel would leave the weight's memory at its last panel.
    let whole = k / TILE * TILE;
    let mut tail = vec![0u32; TILE * PANEL];
    tail[..(k - whole) * PANEL].copy_from_slice(&panel[whole * PANEL..]);
    let mut sums = [0i32; TILE * PANEL];
    let config = Config::tiles();
    // SAFETY (all below): the tiles read `a` (TILE rows of `depth` words), the panel's rows
    // `[q, q + TILE)` for `q + TILE <= k` or `tail`, 64 bytes of each at a stride of 256, and
    // write `sums` (TILE rows of 64 int32); the rows read through `rows_of` exist (the
    // caller's); the tile state was granted (`isa::int8_tiles`).
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
        let mut r0 = range.start;
        while r0 < range.end {
            let rows = (range.end - r0).min(TILE);
            for r in 0..rows {
                for t in 0..s.taps {
                    let to = a.as_mut_ptr().add(r * depth + t * s.cin);
                    std::ptr::copy_nonoverlapping(rows_of.at(r0 + r, t), to, s.cin);
                }
            }
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
            let mut q = 0;
            while q < k {
                let b = if q + TILE <= k { panel.as_ptr().add(q * PANEL) } else { tail.as_ptr() };
                asm!(
                    "tileloadd tmm4, [{a} + {lda}*1]",
                    "tileloadd tmm5, [{b} + {ldb}*1]",
                    "tdpbusd tmm0, tmm4, tmm5",
                    "tileloadd tmm6, [{b} + {ldb}*1 + 64]",
                    "tdpbusd tmm1, tmm4, tmm6",
                    "tileloadd tmm5, [{b} + {ldb}*1 + 128]",
                    "tdpbusd tmm2, tmm4, tmm5",
                    "tileloadd tmm6, [{b} + {ldb}*1 + 192]",
                    "tdpbusd tmm3, tmm4, tmm6",
                    a = in(reg) a.as_ptr().add(q),
                    lda = in(reg) depth * 4,
                    b = in(reg) b,
                    ldb = in(reg) PANEL * 4,
                    options(nostack, readonly),
                );
                q += TILE;
            }
            asm!(
                "tilestored [{c} + {ld}*1], tmm0",
                "tilestored [{c} + {ld}*1 + 64], tmm1",
                "tilestored [{c} + {ld}*1 + 128], tmm2",
                "tilestored [{c} + {ld}*1 + 192], tmm3",
                c = in(reg) sums.as_mut_ptr(),
                ld = in(reg) PANEL * 4,
                options(nostack),
            );
            store(&sums, r0, rows, s, out, j);
            r0 += TILE;
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// Rows `[r0, r0 + rows)`'s sums (`sums`, 64 a row) from each column's starting sum, scaled
/// and biased, plus the residual, then the epilogue and the requantization, into `out`
/// (masked past `n`): as `gemm::tile` stores its accumulators.
#[inline(always)]
unsafe fn store(sums: &[i32; TILE * PANEL], r0: usize, rows: usize, s: &Shape, out: *mut f32, j: usize) {
    const V: usize = PANEL / 16;
    // SAFETY (all below): the columns' operands hold `n` values and the output and residual
    // `ldo` a row; masked lanes past `n` are neither read nor written.
    unsafe {
        let masks: [__mmask16; V] = std::array::from_fn(|v| Avx512::first(s.n.saturating_sub(j + v * 16)));
        let per_column = |p: *const f32| -> [Option<__m512>; V] {
            std::array::from_fn(|v| (!p.is_null()).then(|| Avx512::load_masked(masks[v], p.add(j + v * 16))))
        };
        let (bias, scale, start) = (per_column(s.bias), per_column(s.scale), per_column(s.sums.cast()));
        for r in 0..rows {
            for v in 0..V {
                let mut acc = _mm512_loadu_si512(sums.as_ptr().add(r * PANEL + v * 16).cast());
                if let Some(st) = start[v] {
                    acc = _mm512_add_epi32(acc, _mm512_castps_si512(st));
                }
                let mut y = <Pairs as Dot<Avx512>>::finish(acc, scale[v], bias[v]);
                let at = (r0 + r) * s.ldo + j + v * 16;
                if !s.residual.is_null() {
                    y = Avx512::add(y, Avx512::load_masked(masks[v], s.residual.add(at)));
                }
                let mut y = apply::<Avx512>(s.epilogue, y);
                if let Some(q) = &s.requant {
                    y = q.apply::<Avx512>(y);
                }
                Avx512::store_masked(out.add(at), masks[v], y);
            }
        }
    }
}
