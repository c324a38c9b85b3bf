//! Scaled dot-product attention for the few dozen to few hundred tokens of a small model's
//! call, split across threads by (batch, head) and, where heads alone don't share out evenly,
//! by parts of each head's queries.

use std::sync::atomic::{AtomicBool, Ordering};

use super::activation::exp;
use super::simd::Simd;
use super::{Declined, Ran};

/// What masks an attention's scores, per query row.
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    None,
    /// Query `i` sees keys `0..=i` (torch's `is_causal`: the top-left triangle).
    Causal,
    /// Whether each key takes part (nonzero bytes): `[batch, heads, l, s]` at element
    /// strides (0 where broadcast).
    Bool(&'a [u8], [usize; 4]),
    /// What is added to each key's score, laid out as `Bool`'s.
    Float(&'a [f32], [usize; 4]),
}

/// Scaled dot-product attention's sizes: queries `[batch, heads, l, e]`, keys `[batch,
/// heads, s, e]`, values `[batch, heads, s, ev]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    pub batch: usize,
    pub heads: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
    pub scale: f32,
}

impl Attention {
    /// Whether a tensor of `[batch, heads, rows, cols]` at `strides` lies in `len` elements.
    fn fits(&self, len: usize, rows: usize, cols: usize, strides: [usize; 4]) -> bool {
        let dims = [self.batch, self.heads, rows, cols];
        len >= super::span(&dims, &strides)
    }
}

/// The most keys [`attention_f32`] takes. Past the family's `attention_max_keys` (64 keys on
/// AVX2, 512 on AVX-512) up to this many, torch's flash kernel may be the faster, and the
/// runtime measures the two per node (`exec::choice`); beyond, torch's blocked kernel runs.
pub const MAX_KEYS: usize = 1024;

/// The most keys for which [`attention_f32`] runs on this CPU without being measured against
/// torch's kernel (0 where kwexport's kernels don't run).
pub fn unmeasured_keys() -> usize {
    super::isa::kernels().map_or(0, |t| t.attention_max_keys)
}

/// `softmax(q k^T scale + mask) v` for each batch and head, into `out` at element strides for
/// `[batch, heads, l]`, its rows of `ev` contiguous and no two elements at one place (torch's
/// kernel lays its result out densely in the query's order of dimensions). `q`, `k` and `v`
/// are at element strides for their first three dimensions, their last contiguous. For the tokens of a
/// small model's call, where torch's flash kernel spends most of its time on setup: keys are
/// transposed once per head (and scaled, where no mask tensor is given), then each block of
/// query rows (eight on AVX-512, six on AVX2) takes its scores, softmax and weighted values in
/// registers. Returns `false` where a query row has no key to attend
/// or a score is NaN (torch decides what those give), the slices don't fit the sizes, there
/// are more than [`MAX_KEYS`] keys, or kwexport's kernels don't run on this CPU; `out` may
/// then be partly written.
#[allow(clippy::too_many_arguments)]
pub fn attention_f32(
    q: (&[f32], [usize; 3]),
    k: (&[f32], [usize; 3]),
    v: (&[f32], [usize; 3]),
    g: &Attention,
    mask: AttentionMask<'_>,
    out: (&mut [f32], [usize; 3]),
) -> Ran {
    let os = out.1;
    let nonempty = [g.batch, g.heads, g.l, g.s, g.e, g.ev].iter().all(|&n| n > 0);
    let fits = nonempty
        && g.fits(q.0.len(), g.l, g.e, [q.1[0], q.1[1], q.1[2], 1])
        && g.fits(k.0.len(), g.s, g.e, [k.1[0], k.1[1], k.1[2], 1])
        && g.fits(v.0.len(), g.s, g.ev, [v.1[0], v.1[1], v.1[2], 1])
        && g.fits(out.0.len(), g.l, g.ev, [os[0], os[1], os[2], 1])
        && super::apart(g.ev, [(g.batch, os[0]), (g.heads, os[1]), (g.l, os[2])])
        && match mask {
            AttentionMask::Bool(m, ms) => g.fits(m.len(), g.l, g.s, ms),
            AttentionMask::Float(m, ms) => g.fits(m.len(), g.l, g.s, ms),
            _ => true,
        };
    let t = super::table_if(fits)?;
    if g.s > MAX_KEYS {
        return Err(Declined::Shapes);
    }
    let heads = g.batch * g.heads;
    let flops = 2 * heads * g.l * g.s * (g.e + g.ev);
    let threads = super::parallel::share(flops, heads * MOST_PARTS, super::parallel::threads());
    let ops = Operands {
        q: (q.0.as_ptr(), q.1),
        k: (k.0.as_ptr(), k.1),
        v: (v.0.as_ptr(), v.1),
        g: *g,
        mask,
        out: (out.0.as_mut_ptr(), os),
        parts: parts(heads, threads, g.l),
    };
    let units = heads * ops.parts;
    let failed = AtomicBool::new(false);
    super::parallel::for_each(units, threads.min(units), &|begin, end| {
        // SAFETY: the table's functions run on this CPU; the slices hold what the sizes say
        // (checked), and each unit writes its own rows' outputs.
        if !unsafe { (t.attention)(&ops, begin..end) } {
            failed.store(true, Ordering::Relaxed);
        }
    });
    if failed.load(Ordering::Relaxed) {
        return Err(Declined::Values);
    }
    Ok(())
}

/// [`attention_f32`]'s operands as the kernel table's entry takes them: pointers with their
/// strides, shared by the threads of one call.
pub(super) struct Operands<'a> {
    q: (*const f32, [usize; 3]),
    k: (*const f32, [usize; 3]),
    v: (*const f32, [usize; 3]),
    g: Attention,
    mask: AttentionMask<'a>,
    out: (*mut f32, [usize; 3]),
    /// Parts of each head's queries, each a unit of the threads' work ([`parts`]).
    parts: usize,
}

/// The most parts a head's queries are split into.
const MOST_PARTS: usize = 8;

/// How many parts to split each head's queries into so that `heads * parts` units share
/// out evenly over `threads`: a thread's work is its units, and whole heads alone left
/// ViT-Tiny's 3 heads as 2 and 1 on two threads. The fewest parts that share out best,
/// each at least 16 queries (every part transposes its head's keys again).
pub(super) fn parts(heads: usize, threads: usize, l: usize) -> usize {
    let most = (l / 16).clamp(1, MOST_PARTS);
    // The busiest thread's units over the average, in units of 1 / (heads * parts).
    let load = |p: usize| (heads * p).div_ceil(threads) * threads * MOST_PARTS.pow(2) / (heads * p);
    (1..=most).min_by_key(|&p| (load(p), p)).unwrap_or(1)
}

// SAFETY: the inputs are read only and kept alive by the caller for the whole call; the
// threads of one call write the outputs of disjoint heads.
unsafe impl Sync for Operands<'_> {}

/// The units `range` of [`attention_f32`] (part `u % parts` of head `u / parts`, heads counted
/// as `b * heads + h`): the kernel table's entry. `false` where a row has no key to attend or
/// a score isn't finite.
///
/// # Safety
/// `S`'s features must be enabled; the operands hold what the sizes say.
#[inline(always)]
pub(super) unsafe fn heads<S: Simd>(ops: &Operands<'_>, range: std::ops::Range<usize>) -> bool {
    // Blocks of eight query rows where there are 32 registers (16 sums of scores, each key
    // vector loaded once per eight rows: 132 -> 145 G multiply-adds/s at 512 tokens, the
    // same at 32 and 128), six where there are 16 (12 sums: 4 -> 6 rows took ViT-Tiny's
    // attention, 3 heads x 197 x 64, 482 -> 471 us and 512 tokens 4213 -> 3990 us on a Zen 3).
    if S::REGISTERS >= 32 {
        // SAFETY: the caller's.
        unsafe { blocks::<S, 8>(ops, range) }
    } else {
        // SAFETY: the caller's.
        unsafe { blocks::<S, 6>(ops, range) }
    }
}

/// [`heads`] in blocks of `R` query rows.
///
/// # Safety
/// As [`heads`].
#[inline(always)]
unsafe fn blocks<S: Simd, const R: usize>(ops: &Operands<'_>, range: std::ops::Range<usize>) -> bool {
    let ((q, qs), (k, ks), (v, vs), g, mask) = (ops.q, ops.k, ops.v, &ops.g, ops.mask);
    let (l, s, e, ev) = (g.l, g.s, g.e, g.ev);
    let lanes = S::LANES;
    let sp = s.div_ceil(lanes) * lanes;
    // Value vectors per pass of the weighted sum.
    const MOST: usize = 2;
    // Keys transposed in panels of two vectors of keys (`kt[j / w][c][j % w]`), which the
    // scores' tiles read in order: a plain `kt[c][j]` put each tile's `e` rows a power of two
    // apart at 512 keys, all in two of L1's sets (the scores ran at 40% of the weighted
    // sum's rate). Then each block's scores, then probabilities.
    let w = 2 * lanes;
    let mut kt = vec![0.0f32; sp.div_ceil(w) * e * w];
    let mut sc = vec![0.0f32; R * sp];
    let (ktp, scp) = (kt.as_mut_ptr(), sc.as_mut_ptr());
    // SAFETY (all below): the operands hold what the sizes say (the caller's check), and
    // every index stays within them; masked lanes aren't touched.
    unsafe {
        let neg_inf = S::splat(f32::NEG_INFINITY);
        let causal = matches!(mask, AttentionMask::Causal);
        let direct = matches!(mask, AttentionMask::None | AttentionMask::Causal);
        let parts = ops.parts;
        // Where part `p` of a head's queries starts: at an equal share of the rows, or of a
        // causal square's scores, in whole blocks.
        let edge = |p: usize| {
            let share = p as f64 / parts as f64;
            let share = if causal { share.sqrt() } else { share };
            if p == parts {
                l
            } else {
                ((l as f64 * share / R as f64).round() as usize * R).min(l)
            }
        };
        // The head whose keys `kt` holds: consecutive parts of one head transpose them once.
        let mut transposed = None;
        for unit in range {
            let (head, part) = (unit / parts, unit % parts);
            let (b, h) = (head / g.heads, head % g.heads);
            let (kb, vb) = (k.add(b * ks[0] + h * ks[1]), v.add(b * vs[0] + h * vs[1]));
            if transposed.replace(head) != Some(head) {
                // Without a mask tensor the keys are scaled here, once, rather than every
                // score.
                let key_scale = if direct { g.scale } else { 1.0 };
                for j in 0..s {
                    let row = kb.add(j * ks[2]);
                    for c in 0..e {
                        *ktp.add(j / w * e * w + c * w + j % w) = *row.add(c) * key_scale;
                    }
                }
                // Skipping the keys a causal block can't see leaves out their NaNs and
                // infinities, which a kernel that weighs them by 0 (torch's, within its
                // blocks) carries into earlier rows: where the keys or values hold one, torch
                // decides.
                if causal {
                    // `x - x` is 0 for a finite `x` and NaN otherwise; a NaN stays in the sum.
                    let mut sum = S::zero();
                    for (p, n) in (0..s).flat_map(|j| [(kb.add(j * ks[2]), e), (vb.add(j * vs[2]), ev)]) {
                        for c in (0..n).step_by(lanes) {
                            let x = S::load_masked(S::first(n - c), p.add(c));
                            sum = S::add(sum, S::sub(x, x));
                        }
                    }
                    if S::any(S::nan(sum)) {
                        return false;
                    }
                }
            }
            let (mut i0, end) = (edge(part), edge(part + 1));
            while i0 < end {
                let rows = (end - i0).min(R);
                // A causal block's rows see keys `0..i0 + rows` only: the others are neither
                // scored nor weighted (half the work of a square causal attention).
                let s = match mask {
                    AttentionMask::Causal => s.min(i0 + rows),
                    _ => s,
                };
                let nv = s.div_ceil(lanes);
                // Rows past the last repeat it; their results aren't stored.
                let qrow: [*const f32; R] =
                    std::array::from_fn(|r| q.add(b * qs[0] + h * qs[1] + (i0 + r.min(rows - 1)) * qs[2]));
                // The keys row `r` of the block sees, where no mask tensor says.
                let seen = |r: usize| if causal { s.min(i0 + r + 1) } else { s };
                // Without a mask tensor the tile stores each score with its unseen keys as
                // -inf and keeps each row's largest, so the softmax is one pass; `bad` turns
                // NaN where a score isn't finite (NaN or infinite inputs, or an overflow), and
                // the head is then left to torch.
                let mut top = [neg_inf; R];
                let mut bad = S::zero();
                let mut jb = 0;
                while jb < nv {
                    let two = jb + 1 < nv;
                    let mut acc = [[S::zero(); 2]; R];
                    for c in 0..e {
                        let panel = ktp.add(jb / 2 * e * w + c * w);
                        let k0 = S::load(panel);
                        let k1 = if two { S::load(panel.add(lanes)) } else { k0 };
                        for r in 0..R {
                            let qv = S::splat(*qrow[r].add(c));
                            acc[r][0] = S::fma(qv, k0, acc[r][0]);
                            acc[r][1] = S::fma(qv, k1, acc[r][1]);
                        }
                    }
                    for (r, a) in acc.iter().enumerate() {
                        for (t, &x) in a.iter().enumerate().take(1 + usize::from(two)) {
                            let j0 = (jb + t) * lanes;
                            let x = if direct {
                                bad = S::add(bad, S::sub(x, x));
                                let x = if j0 + lanes > seen(r) {
                                    S::select(S::first(seen(r).saturating_sub(j0)), x, neg_inf)
                                } else {
                                    x
                                };
                                top[r] = S::max(top[r], x);
                                x
                            } else {
                                x
                            };
                            S::store(scp.add(r * sp + j0), x);
                        }
                    }
                    jb += 2;
                }
                if direct && S::any(S::nan(bad)) {
                    return false;
                }
                // Softmax of each row, its scale left for the weighted sum.
                let mut inv = [0.0f32; R];
                if direct {
                    for (r, inv) in inv.iter_mut().enumerate().take(rows) {
                        let (row, m, n) = (scp.add(r * sp), S::splat(S::reduce_max(top[r])), seen(r));
                        let mut sum = S::zero();
                        for j0 in (0..s).step_by(lanes) {
                            let p = exp::<S>(S::sub(S::load(row.add(j0)), m));
                            let p = S::select(S::first(n.saturating_sub(j0)), p, S::zero());
                            S::store(row.add(j0), p);
                            sum = S::add(sum, p);
                        }
                        *inv = 1.0 / S::reduce_add(sum);
                    }
                }
                // With a mask tensor: the mask, then the softmax.
                for (r, inv) in inv.iter_mut().enumerate().take(if direct { 0 } else { rows }) {
                    let i = i0 + r;
                    let row = scp.add(r * sp);
                    let mut mx = neg_inf;
                    for jb in 0..nv {
                        let j0 = jb * lanes;
                        let keys = S::first(s - j0.min(s));
                        let mut valid = keys;
                        let mut x = S::mul(S::load(row.add(j0)), S::splat(g.scale));
                        match mask {
                            // Taken by the one-pass softmax above.
                            AttentionMask::None | AttentionMask::Causal => {}
                            AttentionMask::Bool(m, ms) => {
                                let at = m.as_ptr().add(b * ms[0] + h * ms[1] + i * ms[2] + j0 * ms[3]);
                                let mut taken = [0f32; 16];
                                for (t, one) in taken.iter_mut().enumerate().take((s - j0).min(lanes)) {
                                    *one = f32::from(*at.add(t * ms[3]) != 0);
                                }
                                valid = S::and(valid, S::ne(S::load(taken.as_ptr()), S::zero()));
                            }
                            AttentionMask::Float(m, ms) => {
                                let at = m.as_ptr().add(b * ms[0] + h * ms[1] + i * ms[2] + j0 * ms[3]);
                                let add = if ms[3] == 1 {
                                    S::load_masked(valid, at)
                                } else {
                                    let mut row = [0f32; 16];
                                    for (t, a) in row.iter_mut().enumerate().take((s - j0).min(lanes)) {
                                        *a = *at.add(t * ms[3]);
                                    }
                                    S::load(row.as_ptr())
                                };
                                x = S::add(x, add);
                            }
                        }
                        // A NaN score (a NaN or an infinity in the queries or keys) makes
                        // torch's softmax NaN in ways that depend on how its kernel masks and
                        // blocks: torch decides.
                        if S::any(S::and(keys, S::nan(x))) {
                            return false;
                        }
                        // A score of -inf (masked, or a float mask's) takes no part.
                        valid = S::and(valid, S::ne(x, neg_inf));
                        x = S::select(valid, x, neg_inf);
                        S::store(row.add(j0), x);
                        mx = S::max(mx, x);
                    }
                    let m = S::reduce_max(mx);
                    if m == f32::NEG_INFINITY {
                        return false;
                    }
                    let mut sum = S::zero();
                    for jb in 0..nv {
                        let x = S::load(row.add(jb * lanes));
                        let taken = S::ne(x, neg_inf);
                        let p = S::select(taken, exp::<S>(S::sub(x, S::splat(m))), S::zero());
                        S::store(row.add(jb * lanes), p);
                        sum = S::add(sum, p);
                    }
                    *inv = 1.0 / S::reduce_add(sum);
                }
                // The weighted values, `MOST` vectors of columns at a time.
                let mut c0 = 0;
                while c0 < ev {
                    let width = (ev - c0).min(MOST * lanes);
                    let masks: [S::M; MOST] = std::array::from_fn(|t| S::first(width.saturating_sub(lanes * t)));
                    let used = width.div_ceil(lanes);
                    let mut acc = [[S::zero(); MOST]; R];
                    // Whole vectors (the usual head sizes) without masks, each row's
                    // probabilities from its own pointer: the general loop below spilled its
                    // pointers and branched on its masks at every key.
                    if width == MOST * lanes {
                        let prow: [*const f32; R] = std::array::from_fn(|r| scp.add(r * sp).cast_const());
                        let mut vrow = vb.add(c0);
                        for j in 0..s {
                            let vv: [S::V; MOST] = std::array::from_fn(|t| S::load(vrow.add(lanes * t)));
                            for (a, p) in acc.iter_mut().zip(prow) {
                                let p = S::splat(*p.add(j));
                                for t in 0..MOST {
                                    a[t] = S::fma(p, vv[t], a[t]);
                                }
                            }
                            vrow = vrow.add(vs[2]);
                        }
                    } else {
                        for j in 0..s {
                            let vrow = vb.add(j * vs[2] + c0);
                            let vv: [S::V; MOST] = std::array::from_fn(|t| {
                                if t < used {
                                    S::load_masked(masks[t], vrow.add(lanes * t))
                                } else {
                                    S::zero()
                                }
                            });
                            for (r, a) in acc.iter_mut().enumerate() {
                                let p = S::splat(*scp.add(r * sp + j));
                                for t in 0..MOST {
                                    a[t] = S::fma(p, vv[t], a[t]);
                                }
                            }
                        }
                    }
                    for r in 0..rows {
                        let o = ops.out.0.add(b * ops.out.1[0] + h * ops.out.1[1] + (i0 + r) * ops.out.1[2] + c0);
                        let scale = S::splat(inv[r]);
                        for t in 0..used {
                            S::store_masked(o.add(lanes * t), masks[t], S::mul(acc[r][t], scale));
                        }
                    }
                    c0 += MOST * lanes;
                }
                i0 += R;
            }
        }
    }
    true
}
