//! The one place that decides which instruction set's kernels run: a table of kernel entry
//! points per instruction set (each kernel instantiated inside a function that enables the
//! set's features), chosen once per process from the CPU's features, or forced by
//! `KWEXPORT_ISA=avx512|avx2|portable` for tests and benchmarks. Kernels never check the CPU
//! themselves: they run what [`kernels`] returns.

use std::sync::OnceLock;

use super::activation::Epilogue;
use super::{attention, conv, gemm, pool, simd, winograd};

/// An instruction-set family of kwexport's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F and AVX-512BW (every AVX-512 server CPU has both): 16 lanes, 32 registers.
    Avx512,
    /// AVX2 and FMA: 8 lanes, 16 registers.
    Avx2,
    /// Plain Rust the compiler vectorizes, on any target.
    Portable,
}

impl Isa {
    /// Every family, best first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Portable];

    /// The name `KWEXPORT_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }

    /// Whether this CPU runs the family's instructions.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Isa::Avx512 => has!("avx512f") && has!("avx512bw"),
                Isa::Avx2 => has!("avx2") && has!("fma"),
                Isa::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Portable
        }
    }

    /// The family's kernel table, `None` where this CPU lacks its instructions.
    pub fn table(self) -> Option<&'static Table> {
        if !self.supported() {
            return None;
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Some(&AVX512),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Some(&AVX2),
            _ => Some(&PORTABLE),
        }
    }
}

/// Whether this CPU has AVX512-BF16 (`super::bf16`'s `vdpbf16ps`), beside AVX-512F.
pub fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        Isa::Avx512.supported() && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether torch's own vectorized CPU kernels run their AVX-512 variants in this process:
/// `ATEN_CPU_CAPABILITY` where set, else whether the CPU has AVX-512F (torch's default). Its
/// GELU differs at +inf between its variants (NaN on AVX-512, +inf on AVX2), and kwexport's
/// gives what eager gives.
pub(super) fn torch_uses_avx512() -> bool {
    static AVX512: OnceLock<bool> = OnceLock::new();
    *AVX512.get_or_init(|| match std::env::var("ATEN_CPU_CAPABILITY").as_deref() {
        Ok("avx512") => Isa::Avx512.supported(),
        Ok("") | Err(_) => Isa::Avx512.supported(),
        Ok(_) => false,
    })
}

/// One instruction set's kernels (see each entry's generic body for its contract).
pub struct Table {
    pub isa: Isa,
    /// The columns of a weight panel stored together for this family's GEMM tiles
    /// (`super::gemm::Strips`).
    pub(super) strip: usize,
    /// The most keys for which the attention kernel runs without being measured against
    /// torch's flash kernel (`super::attention::MAX_KEYS`): on AVX2 at 32 tokens kwexport's
    /// took 0.61× torch's time, at 128 1.06–1.4× non-causal but 0.66–0.75× causal.
    pub attention_max_keys: usize,
    pub(super) epilogue: unsafe fn(Epilogue, &mut [f32]),
    pub(super) gelu: unsafe fn(&[f32], bool, &mut [f32]),
    pub(super) gemm_block: gemm::Block<f32>,
    /// The int8 GEMM's block on pairs of int16 (`super::int8`); the blocks on quads are
    /// [`int8`]'s.
    pub(super) gemm_pairs: gemm::Block<u32>,
    /// The bfloat16 GEMM's block (`super::bf16`), each pair as two FMAs; AVX512-BF16's is
    /// [`bf16_block`]'s.
    pub(super) gemm_bf16: gemm::Block<u32>,
    /// The int8 GEMM's input quantizers (`super::int8::quantize`): to int16 pairs and to
    /// byte quads.
    pub(super) quantize_pairs: super::int8::Quantize,
    pub(super) quantize_quads: super::int8::Quantize,
    /// Dynamic quantization's range of an input (`super::int8::range`).
    pub(super) range: unsafe fn(&[f32]) -> Option<(f32, f32)>,
    /// A quantize then dequantize per tensor in one pass (`super::int8::fake_quantize`).
    pub(super) fake_quantize: unsafe fn(&[f32], &super::int8::Requant, &mut [f32]),
    pub(super) depthwise: conv::Rows<conv::Depthwise>,
    pub(super) direct: conv::Rows<conv::Conv2d>,
    pub(super) attention: unsafe fn(&attention::Operands<'_>, std::ops::Range<usize>) -> bool,
    pub(super) max_pool: unsafe fn(&pool::Operands, std::ops::Range<usize>),
    pub(super) winograd: winograd::Run,
    /// The int8 GEMM's block on int16 pairs storing raw int32 sums (`gemm::Words`), and the
    /// int8 Winograd convolution's bands over it (`super::int8::winograd`).
    pub(super) gemm_words: gemm::Block<u32>,
    pub(super) winograd_int8: super::int8::winograd::Run,
}

/// A [`Table`] of `$simd`'s kernels, each entry compiled with `$features` enabled (none for
/// the portable family), so that every generic body inlines to the set's instructions.
macro_rules! table {
    ($isa:expr, $simd:ty, $keys:expr $(, $features:literal)?) => {{
        type S = $simd;
        $(#[target_feature(enable = $features)])?
        unsafe fn epilogue(e: Epilogue, x: &mut [f32]) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { super::activation::epilogue_slice::<S>(e, x) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn gelu(x: &[f32], tanh: bool, out: &mut [f32]) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { super::activation::gelu_slice::<S>(x, tanh, out) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn gemm_block(
            source: gemm::Source<f32>,
            range: std::ops::Range<usize>,
            s: &gemm::Shape,
            panels: &[f32],
            out: gemm::Out,
            j: usize,
            k: usize,
        ) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { gemm::block::<S, gemm::F32>(source, range, s, panels, out, j, k) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn gemm_pairs(
            source: gemm::Source<u32>,
            range: std::ops::Range<usize>,
            s: &gemm::Shape,
            panels: &[u32],
            out: gemm::Out,
            j: usize,
            k: usize,
        ) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { gemm::block::<S, gemm::Pairs>(source, range, s, panels, out, j, k) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn gemm_bf16(
            source: gemm::Source<u32>,
            range: std::ops::Range<usize>,
            s: &gemm::Shape,
            panels: &[u32],
            out: gemm::Out,
            j: usize,
            k: usize,
        ) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { gemm::block::<S, gemm::Bf16>(source, range, s, panels, out, j, k) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn quantize_pairs(x: &[f32], k: [usize; 2], q: &super::int8::Levels, out: &mut [u32]) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { super::int8::quantize::<S, i16>(x, k, q, out) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn quantize_quads(x: &[f32], k: [usize; 2], q: &super::int8::Levels, out: &mut [u32]) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { super::int8::quantize::<S, u8>(x, k, q, out) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn range(x: &[f32]) -> Option<(f32, f32)> {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { super::int8::range::<S>(x) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn fake_quantize(x: &[f32], q: &super::int8::Requant, out: &mut [f32]) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { super::int8::fake_quantize::<S>(x, q, out) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn depthwise(ops: &conv::Operands<conv::Depthwise>, range: std::ops::Range<usize>) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { conv::depthwise::<S>(ops, range) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn direct(ops: &conv::Operands<conv::Conv2d>, range: std::ops::Range<usize>) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { conv::direct::<S>(ops, range) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn attention(ops: &attention::Operands<'_>, range: std::ops::Range<usize>) -> bool {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { attention::heads::<S>(ops, range) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn max_pool(ops: &pool::Operands, range: std::ops::Range<usize>) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { pool::max_pool_rows::<S>(ops, range) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn winograd(ops: &winograd::Operands<'_>, range: std::ops::Range<usize>) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { winograd::bands(ops, range) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn gemm_words(
            source: gemm::Source<u32>,
            range: std::ops::Range<usize>,
            s: &gemm::Shape,
            panels: &[u32],
            out: gemm::Out,
            j: usize,
            k: usize,
        ) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { gemm::block::<S, gemm::Words>(source, range, s, panels, out, j, k) }
        }
        $(#[target_feature(enable = $features)])?
        unsafe fn winograd_int8(ops: &super::int8::winograd::Operands<'_>, range: std::ops::Range<usize>) {
            // SAFETY: `Isa::table` hands this entry out only where the CPU has the features it
            // enables; the caller upholds the generic body\'s contract.
            unsafe { super::int8::winograd::bands::<S>(ops, range) }
        }
        Table {
            isa: $isa,
            strip: super::gemm::strip::<S>(),
            attention_max_keys: $keys,
            epilogue,
            gelu,
            gemm_block,
            gemm_pairs,
            gemm_bf16,
            quantize_pairs,
            quantize_quads,
            range,
            fake_quantize,
            depthwise,
            direct,
            attention,
            max_pool,
            winograd,
            gemm_words,
            winograd_int8,
        }
    }};
}

// SAFETY (the entries' features): `Isa::table` hands out a table only where
// `Isa::supported` found its features.
#[cfg(target_arch = "x86_64")]
static AVX512: Table = table!(Isa::Avx512, simd::avx512::Avx512, 512, "avx512f,avx512bw");
#[cfg(target_arch = "x86_64")]
static AVX2: Table = table!(Isa::Avx2, simd::avx2::Avx2, 64, "avx2,fma");
static PORTABLE: Table = table!(Isa::Portable, simd::portable::Portable, 64);

/// The bfloat16 GEMM's block for a table's family, and whether it is AVX512-BF16's
/// `vdpbf16ps` (`bf16::Native`, on the AVX-512 family where the CPU has it) rather than the
/// family's two FMAs per pair.
pub(super) fn bf16_block(t: &Table) -> (gemm::Block<u32>, bool) {
    #[cfg(target_arch = "x86_64")]
    if t.isa == Isa::Avx512 && has_avx512_bf16() {
        return (avx512_bf16_block, true);
    }
    (t.gemm_bf16, false)
}

/// A GEMM block of a micro-kernel that needs instructions beside its family's (`$features`
/// enabled): the choosers below hand it out only where the CPU has them.
macro_rules! extension_block {
    ($(#[$doc:meta])* $name:ident, $simd:ty, $dot:ty, $features:literal) => {
        extension_block!($(#[$doc])* $name, $simd, $dot, u32, $features);
    };
    ($(#[$doc:meta])* $name:ident, $simd:ty, $dot:ty, $x:ty, $features:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// As [`gemm::block`]'s, on a CPU with the features it enables.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name(
            source: gemm::Source<$x>,
            range: std::ops::Range<usize>,
            s: &gemm::Shape,
            panels: &[$x],
            out: gemm::Out,
            j: usize,
            k: usize,
        ) {
            // SAFETY: the caller's, with the features enabled above.
            unsafe { gemm::block::<$simd, $dot>(source, range, s, panels, out, j, k) }
        }
    };
}

extension_block!(
    /// AVX512-BF16's bfloat16 GEMM block ([`bf16_block`]).
    avx512_bf16_block, simd::avx512::Avx512, super::bf16::Native, "avx512f,avx512bw,avx512bf16"
);
extension_block!(
    /// AVX512-VNNI's int8 GEMM block ([`int8`]).
    avx512_vnni_block, simd::avx512::Avx512, super::int8::Vnni, "avx512f,avx512bw,avx512vnni"
);
extension_block!(
    /// AVX512-VNNI's int8 GEMM block for groups of at most 8 outputs in lane pairs
    /// (`super::int8::Paired`, [`int8`]).
    avx512_vnni_paired_block, simd::avx512::Avx512, super::int8::Paired<super::int8::Vnni>, [u32; 2],
    "avx512f,avx512bw,avx512vnni"
);
extension_block!(
    /// The int8 GEMM block on quads without VNNI for groups of at most 8 outputs in lane
    /// pairs (`super::int8::Paired`, [`int8`]).
    avx512_madd_paired_block, simd::avx512::Avx512, super::int8::Paired<super::int8::Madd>, [u32; 2],
    "avx512f,avx512bw"
);
extension_block!(
    /// AVX-VNNI's int8 GEMM block, on AVX2's vectors ([`int8`]).
    avx2_vnni_block, simd::avx2::Avx2, super::int8::Vnni, "avx2,fma,avxvnni"
);
extension_block!(
    /// The int8 GEMM block on quads without VNNI (`vpmaddubsw`), on AVX-512's vectors
    /// ([`int8`]).
    avx512_madd_block, simd::avx512::Avx512, super::int8::Madd, "avx512f,avx512bw"
);
extension_block!(
    /// The int8 GEMM block on quads without VNNI (`vpmaddubsw`), on AVX2's vectors
    /// ([`int8`]).
    avx2_madd_block, simd::avx2::Avx2, super::int8::Madd, "avx2,fma"
);

/// An int8 GEMM (`super::int8`): its block, the weight layout the block reads, the
/// quantizer of its input rows to that layout, whether its int16 pair sums saturate
/// (`vpmaddubsw`: exact only where `super::int8::madd_fits`), and whether it is AMX's tiles
/// (which also read a stride-1 convolution's taps in place, `super::int8::amx::Shifted`).
#[derive(Clone, Copy)]
pub(super) struct Int8 {
    pub(super) block: gemm::Block<u32>,
    pub(super) layout: super::int8::Layout,
    pub(super) quantize: super::int8::Quantize,
    pub(super) saturates: bool,
    pub(super) tiles: bool,
    /// The block for a grouped convolution's groups of at most 8 outputs in lane pairs
    /// (`super::int8::conv::pairs_groups`), where the kernel has one: AVX-512's quads.
    pub(super) paired: Option<gemm::Block<[u32; 2]>>,
}

/// The int8 GEMM of a table's family that reads `layout`: for quads VNNI's where the CPU has
/// it for the family's vectors (AVX512-VNNI for the AVX-512 family, AVX-VNNI for AVX2), else
/// `vpmaddubsw`'s on x86 (AVX-512BW or AVX2), none on the portable family; for pairs the
/// family's int16 pairs.
pub(super) fn int8(t: &'static Table, layout: super::int8::Layout) -> Option<Int8> {
    match layout {
        super::int8::Layout::Pairs => Some(int8_pairs(t)),
        super::int8::Layout::Quads => int8_amx(t).or_else(|| int8_vnni(t)).or_else(|| int8_madd(t)),
    }
}

/// Whether the AVX-512 family's int8 GEMM on quads runs on AMX's tiles
/// (`super::int8::amx`): the CPU has them and Linux granted their state ([`amx_granted`],
/// asked once), and `KWEXPORT_AMX` isn't `0` (which keeps AVX512-VNNI's kernel, to compare).
pub fn int8_tiles() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| std::env::var("KWEXPORT_AMX").map_or(true, |v| v != "0") && amx_granted())
}

/// Whether the CPU has AMX-TILE and AMX-INT8 beside AVX512-VNNI, and Linux granted this
/// process the tiles' state: `ARCH_REQ_XCOMP_PERM` for `XFEATURE_XTILEDATA` (Linux 5.16+),
/// for all its threads. Refused (an older kernel, a seccomp filter), the tiles would fault.
fn amx_granted() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        use std::arch::is_x86_feature_detected as has;
        let vnni = Isa::Avx512.supported() && has!("avx512vnni");
        // `cpuid` leaf 7 exists on every CPU with AVX-512 (checked first): EDX bits 24
        // and 25 are AMX-TILE and AMX-INT8.
        let edx = if vnni { std::arch::x86_64::__cpuid_count(7, 0).edx } else { 0 };
        let amx = edx & (1 << 24) != 0 && edx & (1 << 25) != 0;
        // SAFETY: a syscall with integer arguments that writes no memory of ours.
        amx && unsafe { libc::syscall(libc::SYS_arch_prctl, 0x1023, 18) } == 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        false
    }
}

/// AMX's int8 tiles on the AVX-512 family, where the CPU has AMX-INT8 and Linux granted
/// the tile state (`super::int8::amx`).
fn int8_amx(t: &'static Table) -> Option<Int8> {
    #[cfg(target_arch = "x86_64")]
    if t.isa == Isa::Avx512 && int8_tiles() {
        let block: gemm::Block<u32> = super::int8::amx::block;
        let quantize = t.quantize_quads;
        let layout = super::int8::Layout::Quads;
        return Some(Int8 { block, layout, quantize, saturates: false, tiles: true, paired: None });
    }
    let _ = t;
    None
}

/// A family's int16 pairs.
fn int8_pairs(t: &'static Table) -> Int8 {
    Int8 {
        block: t.gemm_pairs,
        layout: super::int8::Layout::Pairs,
        quantize: t.quantize_pairs,
        saturates: false,
        tiles: false,
        paired: None,
    }
}

/// A family's quads on VNNI, where the CPU has it for the family's vectors.
fn int8_vnni(t: &'static Table) -> Option<Int8> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let quads = |block, paired| Int8 {
            block,
            layout: super::int8::Layout::Quads,
            quantize: t.quantize_quads,
            saturates: false,
            tiles: false,
            paired,
        };
        // A table is handed out only where the CPU has its family (`Isa::table`).
        match t.isa {
            Isa::Avx512 if has!("avx512vnni") => {
                let paired: gemm::Block<[u32; 2]> = avx512_vnni_paired_block;
                return Some(quads(avx512_vnni_block, Some(paired)));
            }
            Isa::Avx2 if has!("avxvnni") => return Some(quads(avx2_vnni_block, None)),
            _ => {}
        }
    }
    None
}

/// A family's quads on `vpmaddubsw` (every x86 family).
fn int8_madd(t: &'static Table) -> Option<Int8> {
    #[cfg(target_arch = "x86_64")]
    {
        let quads = |block, paired| Int8 {
            block,
            layout: super::int8::Layout::Quads,
            quantize: t.quantize_quads,
            saturates: true,
            tiles: false,
            paired,
        };
        match t.isa {
            Isa::Avx512 => {
                let paired: gemm::Block<[u32; 2]> = avx512_madd_paired_block;
                return Some(quads(avx512_madd_block, Some(paired)));
            }
            Isa::Avx2 => return Some(quads(avx2_madd_block, None)),
            Isa::Portable => {}
        }
    }
    None
}

/// The layout a table's family packs an int8 weight in: quads where its quads kernel is
/// exact for the weight (VNNI's always; `vpmaddubsw`'s where `madd_fits`, which the caller
/// computed from the weight and its input's levels), else pairs.
pub(super) fn int8_layout(t: &'static Table, madd_fits: bool) -> super::int8::Layout {
    match int8(t, super::int8::Layout::Quads) {
        Some(quads) if !quads.saturates || madd_fits => super::int8::Layout::Quads,
        _ => super::int8::Layout::Pairs,
    }
}

/// Every int8 GEMM a table's family can run here, VNNI's and `vpmaddubsw`'s both where the CPU
/// has VNNI (the tests check each).
#[cfg(test)]
pub(super) fn int8_variants(t: &'static Table) -> Vec<Int8> {
    [int8_amx(t), int8_vnni(t), int8_madd(t), Some(int8_pairs(t))].into_iter().flatten().collect()
}

/// The family this process runs and why: the best this CPU has, or `KWEXPORT_ISA`'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Detected; the portable family runs torch's kernels instead (it is for correctness on
    /// any target, not tuned to beat them).
    Detected(Isa),
    /// Forced by `KWEXPORT_ISA`.
    Forced(Isa),
    /// `KWEXPORT_ISA` names a family this CPU lacks, or none: kwexport's kernels are off.
    Refused,
}

/// [`Choice`] for this process, read once.
pub fn choice() -> Choice {
    static CHOICE: OnceLock<Choice> = OnceLock::new();
    *CHOICE.get_or_init(|| match std::env::var("KWEXPORT_ISA") {
        Ok(name) if !name.is_empty() => match Isa::ALL.into_iter().find(|i| i.name() == name) {
            Some(isa) if isa.supported() => Choice::Forced(isa),
            _ => Choice::Refused,
        },
        _ => Choice::Detected(Isa::ALL.into_iter().find(|i| i.supported()).unwrap_or(Isa::Portable)),
    })
}

#[cfg(test)]
thread_local! {
    /// The family a test forces on its thread ([`with`]).
    static TEST_ISA: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with `isa`'s kernels on this thread (tests only; threads a kernel starts use
/// the table its caller fetched).
#[cfg(test)]
pub(crate) fn with<T>(isa: Isa, f: impl FnOnce() -> T) -> T {
    let before = TEST_ISA.with(|t| t.replace(Some(isa)));
    let result = f();
    TEST_ISA.with(|t| t.set(before));
    result
}

/// Forces `isa`'s kernels on this thread until dropped ([`with`] for a loop's body: a
/// weight packed inside it is in the strips of the family that reads it).
#[cfg(test)]
pub(crate) fn force(isa: Isa) -> Forced {
    Forced(TEST_ISA.with(|t| t.replace(Some(isa))))
}

/// [`force`]'s guard: restores the thread's family before it.
#[cfg(test)]
pub(crate) struct Forced(Option<Isa>);

#[cfg(test)]
impl Drop for Forced {
    fn drop(&mut self) {
        TEST_ISA.with(|t| t.set(self.0));
    }
}

/// The families this CPU has (for tests: each is checked against the reference).
pub fn supported() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.supported()).collect()
}

/// The kernels to run, `None` where kwexport's own don't run here (no vector family
/// detected, or `KWEXPORT_ISA` refused): callers then run torch's.
pub fn kernels() -> Option<&'static Table> {
    #[cfg(test)]
    if let Some(isa) = TEST_ISA.with(|t| t.get()) {
        return isa.table();
    }
    match choice() {
        Choice::Forced(isa) => isa.table(),
        Choice::Detected(Isa::Portable) | Choice::Refused => None,
        Choice::Detected(isa) => isa.table(),
    }
}
