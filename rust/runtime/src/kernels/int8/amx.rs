//! AMX's int8 tiles for the quad layout (`super::Layout::Quads`): `tdpbusd` sums 16 × 16
//! int32 lanes of 64 byte products each per instruction, where AVX512-VNNI's `vpdpbusd` sums
//! 16 lanes of 4. A block of the GEMM driver (`gemm::Block`, the weight's 64-column panel)
//! runs 32 rows at a time, two tiles of rows by two of columns into four accumulator tiles,
//! once per half of the panel: the rows read as tiles in place where they are dense and
//! whole tile rows deep, otherwise gathered into zero-padded tile rows (so that a
//! convolution's taps read as one row); the panel's rows read as tiles in place (a panel row
//! is 64 words, so a tile's 16 columns are 64 bytes of each 256); then the sums finished as
//! the vector kernels finish theirs. A stride-1 convolution of whole tile rows of channels
//! has a driver of its own ([`conv_shifted`]), whose tiles read each tap's rows where they
//! lie in the padded image: no table of pointers, nothing gathered.
//!
//! Linux hands AMX's 8 KB of tile state to a process only once asked (`arch_prctl`), which
//! `super::super::isa::int8_tiles` does once; the kernel is chosen there only where that
//! succeeded on a CPU with AMX-INT8 and AVX512-VNNI.

use std::arch::asm;
use std::arch::x86_64::*;

use super::super::activation::apply;
use super::super::gemm::{self, Dot, Out, Pairs, Rows, Shape, Source};
use super::super::simd::{avx512::Avx512, Simd};
use super::super::PANEL;
use super::conv::Patches;

/// A tile's rows, and 32-bit words per row (64 bytes: 16 quads of `k`).
pub(in super::super) const TILE: usize = 16;

/// What a block needs to run on the tiles (smaller ones run on AVX512-VNNI's kernel): a
/// tile of rows, half a panel of columns or more, and a whole panel over a tile row of `k`'s
/// words or at least `MIN_WORDS_BY_COLUMNS` of them times its columns. Measured on a Xeon
/// (Emerald Rapids, one thread, against VNNI): 16 rows at `[16, 768] x [768, 768]` 0.62 of
/// VNNI's time, 8 rows 1.44; 64 columns at 16 words (a 1×1 over 64 channels: ResNet's
/// strided shortcut) 0.75, at 37 words (ResNet's 7×7 stem) 0.81; 32 columns at 96 words
/// 0.71 but at 36 words 1.32; 24 columns 1.09–1.48 at 24–144 words.
const MIN_WORDS_BY_COLUMNS: usize = 2048;

fn tiles_pay(rows: usize, width: usize, k: usize) -> bool {
    let deep = match width == PANEL {
        true => k >= TILE,
        false => k * width >= MIN_WORDS_BY_COLUMNS,
    };
    rows >= TILE && width >= PANEL / 2 && deep
}

/// `ldtilecfg`'s 64 bytes: palette 1; tiles 0–3 the sums (16 rows of 16 int32), 4 and 5
/// the rows' bytes, 6 and 7 the panel's (16 rows of 64 bytes each).
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
        for t in 0..8 {
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
    let width = (s.n - j).min(PANEL);
    if !tiles_pay(range.len(), width, k) {
        // SAFETY: the caller's; AVX512-VNNI is enabled above (every AMX CPU has it).
        return unsafe { gemm::block::<Avx512, super::Vnni>(source, range, s, panels, op, j, k) };
    }
    let tiles = gemm::tiles_shape(s);
    // SAFETY (all below): as the caller guarantees.
    unsafe {
        match source {
            Source::Dense(d) => {
                // In place where each row's `k` words are whole tile rows: a tile reads no
                // word past a row's `k`.
                let place = match k.is_multiple_of(TILE) {
                    true => Place::Dense { x: d.x, ld: d.ld },
                    false => Place::Gathered(d),
                };
                columns(place, range.clone(), &tiles, panels, op.0, j, k, None)
            }
            Source::Table(t) => columns(Place::Gathered(t), range.clone(), &tiles, panels, op.0, j, k, None),
        }
        gemm::gelu_pass::<Avx512>(s, range, op, j);
    }
}

/// Where a block's rows are read as tiles: in place (dense rows `ld` words apart, `k` a
/// whole number of tile rows), shifted per tap ([`Shifted`]), or gathered into a thread's
/// buffer: each tap's words from the rows `R`, or each row's patch ([`Patches`]).
#[derive(Clone, Copy)]
enum Place<R> {
    Dense { x: *const u32, ld: usize },
    Shifted(Shifted),
    Gathered(R),
    Patches(Patches),
}

// SAFETY: every place's rows are memory the caller keeps alive and unwritten for the whole
// GEMM; the threads only read through them.
unsafe impl<R: Sync> Sync for Place<R> {}

/// A stride-1 convolution's rows read in place from its input image, quantized with its
/// padding into `[hp, wp]` pixels of `words` words (a whole number of tile rows): output
/// pixel `(oy, ox)` is virtual row `v = oy * wp + ox`, whose tap `(i, j)` is pixel `v + i *
/// wp + j`, so 16 rows of a tap are 16 pixels evenly apart and a tile reads them where they
/// lie; no table of pointers, nothing gathered. The virtual rows `ox >= wo` of each line
/// (the padding's columns, `wp - wo` of them) are computed and not stored.
#[derive(Clone, Copy)]
pub(in super::super) struct Shifted {
    /// The padded image's first pixel.
    pub(in super::super) x: *const u32,
    pub(in super::super) words: usize,
    /// Each tap's first pixel: `i * wp + j`.
    pub(in super::super) taps: *const usize,
    /// Virtual rows a line (`wp`), and the output's pixels a line (`wo`).
    pub(in super::super) lines: [usize; 2],
}

// SAFETY: the image and the taps' offsets are memory the caller keeps alive and unwritten
// for the whole call; the threads only read through them.
unsafe impl Sync for Shifted {}

impl Rows<u32> for Shifted {
    #[inline(always)]
    unsafe fn at(self, r: usize, t: usize) -> *const u32 {
        // SAFETY: row `r`'s tap `t` exists (the caller's).
        unsafe { self.x.add((r + *self.taps.add(t)) * self.words) }
    }
}

/// The GEMM of [`Shifted`] rows: `m` virtual rows times the weight's panels into `out`'s
/// rows of `s.ldo` (the output pixels only), on the pool's threads as `gemm::columns` splits
/// a GEMM ([`gemm::each_block`]).
///
/// # Safety
/// `super::super::isa::int8_tiles`; every virtual row of the 32-row blocks covering `m`
/// (rounded up) and its taps lie in the image; the panels hold `s`'s weight (`s.taps *
/// words` deep), `out` the output pixels' rows, the shape's other pointers their values.
pub(in super::super) unsafe fn conv_shifted(rows: Shifted, m: usize, s: &Shape, panels: &[u32], out: &mut [f32]) {
    // SAFETY: the caller's.
    unsafe { in_blocks(Place::Shifted(rows), m, s, panels, out) }
}

/// The GEMM of a convolution's [`Patches`] (an image's few channels: `super::conv`'s
/// `Layout::patches`), each block's rows gathered from the image's levels as the tiles run:
/// `m` output pixels times the weight's panels into `out`'s rows of `s.ldo`, on the pool's
/// threads as `gemm::columns` splits a GEMM ([`gemm::each_block`]). The patch matrix itself
/// would be megabytes (a 224-pixel image's 7×7 stem: 12544 rows of 148 bytes) written and read
/// back.
///
/// # Safety
/// `super::super::isa::int8_tiles`; each output pixel's patch lies in the levels; the panels
/// hold `s`'s weight (`s.cin` words deep, the patch's), `out` the `m` rows, the shape's other
/// pointers their values.
pub(super) unsafe fn conv_patches(rows: Patches, m: usize, s: &Shape, panels: &[u32], out: &mut [f32]) {
    // SAFETY: the caller's.
    unsafe { in_blocks(Place::Patches(rows), m, s, panels, out) }
}

/// [`conv_shifted`]'s and [`conv_patches`]' GEMM: `m` rows from `place` times the weight's
/// panels, split over the pool's threads as `gemm::columns` splits a GEMM
/// ([`gemm::each_block`]).
///
/// # Safety
/// As [`conv_shifted`] or [`conv_patches`] says for its rows.
unsafe fn in_blocks(place: Place<Shifted>, m: usize, s: &Shape, panels: &[u32], out: &mut [f32]) {
    let (k, op) = (s.taps * s.cin, Out(out.as_mut_ptr()));
    gemm::each_block(m, s, &|range, j| {
        // SAFETY: the caller's; no other block writes these rows' columns.
        unsafe { in_block(place, range, s, panels, op, j, k) };
    });
}

/// [`in_blocks`]' rows `range` times the panel from `j`, then GELU over them as [`block`]'s
/// (never for [`Shifted`] rows, whose virtual rows aren't the output's; `conv::shifted` takes
/// no GELU). A function of its own: a closure wouldn't have the target features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
unsafe fn in_block(
    place: Place<Shifted>,
    range: std::ops::Range<usize>,
    s: &Shape,
    panels: &[u32],
    op: Out,
    j: usize,
    k: usize,
) {
    let lines = match place {
        Place::Shifted(rows) => Some(rows.lines),
        _ => None,
    };
    // SAFETY: the caller's.
    unsafe {
        columns(place, range.clone(), s, panels, op.0, j, k, lines);
        if lines.is_none() {
            gemm::gelu_pass::<Avx512>(s, range, op, j);
        }
    }
}

thread_local! {
    /// Each thread's gathered rows (`BLOCK` rows of a tile row multiple each), kept between
    /// calls: a block would otherwise allocate and zero them per panel.
    static GATHERED: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows a step of the tiles computes: two tiles of rows by two of columns, four sums.
const BLOCK: usize = 2 * TILE;

/// Rows `range` times the 64 columns from `j`, 32 rows at a time: for each half of the
/// columns, two tiles of rows by two of the panel's columns into four sums (each tile read
/// serves two products, and no tile is loaded into again while a product reads it).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn columns<R: Rows<u32>>(
    place: Place<R>,
    range: std::ops::Range<usize>,
    s: &Shape,
    panels: &[u32],
    out: *mut f32,
    j: usize,
    k: usize,
    lines: Option<[usize; 2]>,
) {
    let depth = k.next_multiple_of(TILE);
    // A gathered row's stride: whole tile rows, off 4 KB multiples (16 rows at such a
    // stride would share an L1 set).
    let lda = if (depth * 4).is_multiple_of(4096) { depth + TILE } else { depth };
    let panel = &panels[j / PANEL * k * PANEL..][..k * PANEL];
    // The panel's last tile of rows where `k` ends inside it, padded with zero rows: a tile
    // read past the panel would leave the weight's memory at its last panel. Those zero rows
    // multiply whatever a row holds past `k`.
    let whole = k / TILE * TILE;
    let mut tail = [0u32; TILE * PANEL];
    tail[..(k - whole) * PANEL].copy_from_slice(&panel[whole * PANEL..]);
    let halves = if s.n - j > PANEL / 2 { 2 } else { 1 };
    let mut sums = [0i32; BLOCK * PANEL];
    let config = Config::tiles();
    // Taken out of the thread's slot, not borrowed in a closure: a closure's body is compiled
    // without its caller's target features wherever it isn't inlined, and the intrinsics
    // below became calls (7× slower).
    let mut a = GATHERED.take();
    if a.len() < BLOCK * lda {
        a.resize(BLOCK * lda, 0);
    }
    // SAFETY (all below): the tiles read 32 rows from `x` at `stride` bytes, each of
    // `depth` words (in place: the block's rows, `depth == k`; gathered: `a`), the
    // panel's rows `[q, q + TILE)` for `q + TILE <= k` or `tail`, 64 bytes of each at a
    // stride of 256, and write `sums` (32 rows of 64 int32); the rows read through
    // `rows_of` exist (the caller's); the tile state was granted (`isa::int8_tiles`).
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
        let mut r0 = range.start;
        while r0 < range.end {
            let rows = (range.end - r0).min(BLOCK);
            let (x, stride) = match place {
                Place::Dense { x, ld } if rows == BLOCK => (x.add(r0 * ld), ld * 4),
                // The rows past the last lie in the image too (the caller's).
                Place::Shifted(sh) => (sh.x.add(r0 * sh.words), sh.words * 4),
                Place::Patches(patches) => {
                    // Rows past the block's last are left as they were: their sums
                    // aren't stored.
                    patches.write_rows(r0, rows, a.as_mut_ptr().cast(), lda * 4, 0);
                    (a.as_ptr(), lda * 4)
                }
                Place::Dense { x, ld } => gather(gemm::Dense { x, ld }, (r0, rows), s, a.as_mut_ptr(), lda),
                Place::Gathered(rows_of) => gather(rows_of, (r0, rows), s, a.as_mut_ptr(), lda),
            };
            for half in 0..halves {
                asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
                let mut q = 0;
                while q < k {
                    let b = if q + TILE <= k { panel.as_ptr().add(q * PANEL) } else { tail.as_ptr() };
                    let a = match place {
                        Place::Shifted(sh) => x.add(*sh.taps.add(q / sh.words) * sh.words + q % sh.words),
                        _ => x.add(q),
                    };
                    let b = b.add(half * PANEL / 2);
                    if rows > TILE {
                        asm!(
                            "tileloadd tmm4, [{a} + {lda}*1]",
                            "tileloadd tmm6, [{b} + {ldb}*1]",
                            "tileloadd tmm7, [{b} + {ldb}*1 + 64]",
                            "tdpbusd tmm0, tmm4, tmm6",
                            "tileloadd tmm5, [{a2} + {lda}*1]",
                            "tdpbusd tmm1, tmm4, tmm7",
                            "tdpbusd tmm2, tmm5, tmm6",
                            "tdpbusd tmm3, tmm5, tmm7",
                            a = in(reg) a,
                            a2 = in(reg) a.byte_add(TILE * stride),
                            lda = in(reg) stride,
                            b = in(reg) b,
                            ldb = in(reg) PANEL * 4,
                            options(nostack, readonly),
                        );
                    } else {
                        // A last block of at most 16 rows: the first tile's products only.
                        asm!(
                            "tileloadd tmm4, [{a} + {lda}*1]",
                            "tileloadd tmm6, [{b} + {ldb}*1]",
                            "tileloadd tmm7, [{b} + {ldb}*1 + 64]",
                            "tdpbusd tmm0, tmm4, tmm6",
                            "tdpbusd tmm1, tmm4, tmm7",
                            a = in(reg) a,
                            lda = in(reg) stride,
                            b = in(reg) b,
                            ldb = in(reg) PANEL * 4,
                            options(nostack, readonly),
                        );
                    }
                    q += TILE;
                }
                asm!(
                    "tilestored [{c} + {ld}*1], tmm0",
                    "tilestored [{c} + {ld}*1 + 64], tmm1",
                    "tilestored [{c2} + {ld}*1], tmm2",
                    "tilestored [{c2} + {ld}*1 + 64], tmm3",
                    c = in(reg) sums.as_mut_ptr().add(half * PANEL / 2),
                    c2 = in(reg) sums.as_mut_ptr().add(TILE * PANEL + half * PANEL / 2),
                    ld = in(reg) PANEL * 4,
                    options(nostack),
                );
            }
            store(&sums, (r0, rows, lines), s, out, j);
            r0 += BLOCK;
        }
        asm!("tilerelease", options(nostack, nomem));
    }
    GATHERED.set(a);
}

/// Rows `[r0, r0 + rows)` of `rows_of`, each tap's `s.cin` words after the last's, into `a`'s
/// rows `lda` apart: the tiles' rows and their stride. Rows past the block's last are left as
/// they were: their sums aren't stored.
///
/// # Safety
/// The rows and their taps exist; `a` holds `rows` rows of `lda >= s.taps * s.cin` words;
/// AVX-512 is enabled (the caller's).
#[inline(always)]
unsafe fn gather<R: Rows<u32>>(
    rows_of: R,
    (r0, rows): (usize, usize),
    s: &Shape,
    a: *mut u32,
    lda: usize,
) -> (*const u32, usize) {
    for r in 0..rows {
        for t in 0..s.taps {
            // SAFETY: the caller's.
            unsafe { copy_words(rows_of.at(r0 + r, t), a.add(r * lda + t * s.cin), s.cin) };
        }
    }
    (a.cast_const(), lda * 4)
}

/// Copies `n` words, 16 to a vector (the last masked), inline: a tap's run is a few dozen
/// bytes (64 for 64 channels), where a call to `memcpy` per tap cost as much as the copy.
///
/// # Safety
/// `src` and `dst` hold `n` words each and don't overlap; AVX-512 is enabled (the caller's).
#[inline(always)]
unsafe fn copy_words(src: *const u32, dst: *mut u32, n: usize) {
    let mut i = 0;
    // SAFETY (all below): words `[i, i + 16)` (masked past `n`) of both, as the caller
    // guarantees.
    unsafe {
        while i + 16 <= n {
            _mm512_storeu_si512(dst.add(i).cast(), _mm512_loadu_si512(src.add(i).cast()));
            i += 16;
        }
        if i < n {
            let mask = Avx512::first(n - i);
            _mm512_mask_storeu_epi32(dst.add(i).cast(), mask, _mm512_maskz_loadu_epi32(mask, src.add(i).cast()));
        }
    }
}

/// Rows `[r0, r0 + rows)`'s sums (`sums`, 64 a row; only the first half where the panel's
/// columns end in it) from each column's starting sum, scaled and biased, plus the residual,
/// then the epilogue and the requantization, into `out` (masked past `n`): as `gemm::tile`
/// stores its accumulators. With `lines` (`[wp, wo]`, [`Shifted`]'s), row `v` is output
/// pixel `v / wp * wo + v % wp`, stored only where `v % wp < wo`.
#[inline(always)]
unsafe fn store(
    sums: &[i32; BLOCK * PANEL],
    (r0, rows, lines): (usize, usize, Option<[usize; 2]>),
    s: &Shape,
    out: *mut f32,
    j: usize,
) {
    const V: usize = PANEL / 16;
    // SAFETY (all below): the columns' operands hold `n` values and the output and residual
    // `ldo` a row; masked lanes past `n` are neither read nor written.
    unsafe {
        // Loops, not `array::from_fn`'s closures: those lose the target features (see
        // `columns`).
        let mut masks: [__mmask16; V] = [0; V];
        for (v, mask) in masks.iter_mut().enumerate() {
            *mask = Avx512::first(s.n.saturating_sub(j + v * 16));
        }
        let (mut bias, mut scale, mut start) = ([None; V], [None; V], [None; V]);
        for v in 0..V {
            for (values, p) in [(&mut bias, s.bias), (&mut scale, s.scale), (&mut start, s.sums.cast())] {
                if !p.is_null() {
                    values[v] = Some(Avx512::load_masked(masks[v], p.add(j + v * 16)));
                }
            }
        }
        for r in 0..rows {
            let row = match lines {
                Some([wp, wo]) if (r0 + r) % wp >= wo => continue,
                Some([wp, wo]) => (r0 + r) / wp * wo + (r0 + r) % wp,
                None => r0 + r,
            };
            for v in 0..V {
                let mut acc = _mm512_loadu_si512(sums.as_ptr().add(r * PANEL + v * 16).cast());
                if let Some(st) = start[v] {
                    acc = _mm512_add_epi32(acc, _mm512_castps_si512(st));
                }
                let mut y = <Pairs as Dot<Avx512>>::finish(acc, scale[v], bias[v]);
                let at = row * s.ldo + j + v * 16;
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
