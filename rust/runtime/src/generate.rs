//! Generation: the decode loop for static-cache programs with transformers' export
//! signatures, in Rust. Between two tokens no Python code runs: the token and its position
//! are written into the step's input tensors, the step's plan runs, and the next token is
//! chosen from the logits' memory, greedily or by sampling.
//!
//! Two shapes of program generate:
//! - a decoder-only LM (`TorchExportableModuleForDecoderOnlyLM`): the method `prog(...)` calls
//!   takes `input_ids` `[1, n]` and `cache_position` `[n]` and returns logits `[1, n, vocab]`;
//! - an encoder-decoder (`Seq2SeqLMExportableModule`'s pair saved as one file): methods
//!   `encode(input_ids)` returning the encoder's hidden states, and `decode(decoder_input_ids,
//!   encoder_hidden_states, cache_position)` returning logits.
//!
//! The KV caches are the program's state: a generation writes them from position 0 on, so a
//! program runs one generation at a time (`copy.copy` it for another).

use std::collections::VecDeque;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::errors::{RtError, RtResult};
use crate::method::Method;

/// How the next token is chosen, with transformers' argument names and order of operations
/// (temperature, then top-k, then top-p, then sampling).
#[derive(Debug, Clone)]
pub struct Sampling {
    /// Sample (else the most likely token, the first of equals).
    pub do_sample: bool,
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the fewest most likely tokens whose probabilities reach `top_p`.
    pub top_p: f64,
    rng: ChaCha8Rng,
}

impl Sampling {
    pub fn new(do_sample: bool, temperature: f64, top_k: usize, top_p: f64, seed: Option<u64>) -> PyResult<Self> {
        if do_sample && !(temperature > 0.0 && temperature.is_finite()) {
            return Err(PyValueError::new_err(format!("temperature must be a positive float, got {temperature}")));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(PyValueError::new_err(format!("top_p must be in (0, 1], got {top_p}")));
        }
        let rng = match seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            // std's hash keys come from the OS's randomness: a fresh seed per generation.
            None => {
                use std::hash::{BuildHasher, Hasher};
                ChaCha8Rng::seed_from_u64(std::collections::hash_map::RandomState::new().build_hasher().finish())
            }
        };
        Ok(Sampling { do_sample, temperature, top_k, top_p, rng })
    }

    /// The next token from one position's logits.
    pub fn choose(&mut self, logits: &[f32]) -> usize {
        if !self.do_sample {
            return argmax(logits);
        }
        let mut scores: Vec<f64> = logits.iter().map(|&l| l as f64 / self.temperature).collect();
        if self.top_k > 0 && self.top_k < scores.len() {
            let mut sorted = scores.clone();
            sorted.sort_unstable_by(|a, b| b.total_cmp(a));
            let kth = sorted[self.top_k - 1];
            scores.iter_mut().filter(|s| **s < kth).for_each(|s| *s = f64::NEG_INFINITY);
        }
        if self.top_p < 1.0 {
            // transformers' TopPLogitsWarper: ascending, drop the tokens whose cumulative
            // probability stays at or below 1 - top_p, keeping the most likely one always.
            let mut order: Vec<usize> = (0..scores.len()).collect();
            order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
            let probs = softmax(&order.iter().map(|&i| scores[i]).collect::<Vec<_>>());
            let mut cumulative = 0.0;
            for (rank, &i) in order.iter().enumerate() {
                cumulative += probs[rank];
                if cumulative <= 1.0 - self.top_p && rank + 1 < order.len() {
                    scores[i] = f64::NEG_INFINITY;
                }
            }
        }
        let probs = softmax(&scores);
        // A uniform draw in [0, 1) from 53 random bits.
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let mut cumulative = 0.0;
        for (i, p) in probs.iter().enumerate() {
            cumulative += p;
            if u < cumulative {
                return i;
            }
        }
        probs.iter().rposition(|&p| p > 0.0).unwrap_or(0)
    }
}

/// The index of the first largest value (as `torch.argmax`); NaN is largest, as in torch.
fn argmax(xs: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x.is_nan() {
            return i;
        }
        if x > xs[best] {
            best = i;
        }
    }
    best
}

fn softmax(scores: &[f64]) -> Vec<f64> {
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scores.iter().map(|s| if s.is_finite() { (s - max).exp() } else { 0.0 }).collect();
    let total: f64 = exps.iter().sum();
    exps.iter().map(|e| e / total).collect()
}

/// When a generation stops.
#[derive(Debug, Clone)]
pub struct Stop {
    pub max_new_tokens: usize,
    pub eos: Vec<i64>,
}

/// One generation in progress: the step method, its input tensors, and where it stands.
pub struct Generation {
    step: Py<Method>,
    /// The step's leaves in order; `ids` and `pos` are rewritten before each step.
    leaves: Vec<Py<PyAny>>,
    ids: usize,
    pos: usize,
    /// CPU addresses of the one-token `ids` and `pos` tensors' data, where they are on the
    /// CPU (`None` on a device: each step fills them through torch, and greedy steps choose
    /// there).
    ids_ptr: Option<usize>,
    pos_ptr: Option<usize>,
    /// Tokens the step must see before it chooses: the prompt, then each chosen token.
    pending: VecDeque<i64>,
    /// The next position to write.
    position: i64,
    /// Prompt tokens the first step may take at once (`input_ids` with a dynamic length).
    prefill_at_once: bool,
    new_tokens: usize,
    stop: Stop,
    sampling: Sampling,
    done: bool,
    /// Every token so far: the prompt (or the decoder's start token), then the new ones.
    pub tokens: Vec<i64>,
}

impl Generation {
    /// A generation of `step` from `prompt`; `fixed` gives the other leaves by path
    /// (the encoder's hidden states).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        py: Python<'_>,
        step: Py<Method>,
        ids_path: &str,
        fixed: &[(&str, Bound<'_, PyAny>)],
        prompt: Vec<i64>,
        cache_len: Option<usize>,
        stop: Stop,
        sampling: Sampling,
    ) -> RtResult<Self> {
        let m = step.get();
        let leaf = |path: &str| {
            m.leaf(path).ok_or_else(|| {
                RtError::Python(PyValueError::new_err(format!(
                    "generate() needs a program whose method {} takes {path}; it takes {}",
                    m.name(),
                    (0..m.n_leaves()).map(|i| format!("leaf {i}")).collect::<Vec<_>>().join(", ")
                )))
            })
        };
        let (ids, pos) = (leaf(ids_path)?, leaf("cache_position")?);
        if prompt.is_empty() {
            return Err(PyValueError::new_err("input_ids holds no tokens").into());
        }
        if stop.max_new_tokens == 0 {
            return Err(PyValueError::new_err("max_new_tokens must be at least 1").into());
        }
        // Positions written: the prompt's, then each new token's but the last.
        let needed = prompt.len() + stop.max_new_tokens - 1;
        if let Some(len) = cache_len.filter(|&len| needed > len) {
            return Err(PyValueError::new_err(format!(
                "{} prompt token(s) and max_new_tokens={} need {needed} cache positions, but the program's static \
                 cache holds {len}",
                prompt.len(),
                stop.max_new_tokens
            ))
            .into());
        }
        let torch = py.import("torch")?;
        let device = m.file().placement.target.clone();
        let one_token = |shape: &[usize]| -> PyResult<Bound<'_, PyAny>> {
            let kwargs = PyDict::new(py);
            kwargs.set_item("dtype", torch.getattr("long")?)?;
            kwargs.set_item("device", &device)?;
            torch.getattr("zeros")?.call((shape.to_vec(),), Some(&kwargs))
        };
        let ids_tensor = one_token(&[1, 1])?;
        let pos_tensor = one_token(&[1])?;
        let on_cpu = device == "cpu";
        let address = |t: &Bound<'_, PyAny>| -> PyResult<Option<usize>> {
            if on_cpu {
                Ok(Some(t.call_method0("data_ptr")?.extract::<usize>()?))
            } else {
                Ok(None)
            }
        };
        let (ids_ptr, pos_ptr) = (address(&ids_tensor)?, address(&pos_tensor)?);
        let mut leaves: Vec<Option<Py<PyAny>>> = (0..m.n_leaves()).map(|_| None).collect();
        leaves[ids] = Some(ids_tensor.unbind());
        leaves[pos] = Some(pos_tensor.unbind());
        for (path, value) in fixed {
            leaves[leaf(path)?] = Some(value.clone().unbind());
        }
        let leaves = leaves
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                l.ok_or_else(|| {
                    RtError::Python(PyValueError::new_err(format!(
                        "generate(): method {} has an input (leaf {i}) generation doesn't know how to fill",
                        m.name()
                    )))
                })
            })
            .collect::<RtResult<Vec<_>>>()?;
        let prefill_at_once = m.leaf_sizes(ids).is_some_and(|s| s.len() == 2 && s[1].is_none())
            && m.leaf_sizes(pos).is_some_and(|s| s.len() == 1 && s[0].is_none());
        Ok(Generation {
            step,
            leaves,
            ids,
            pos,
            ids_ptr,
            pos_ptr,
            pending: prompt.iter().copied().collect(),
            position: 0,
            prefill_at_once,
            new_tokens: 0,
            stop,
            sampling,
            done: false,
            tokens: prompt,
        })
    }

    /// Runs steps until the next token is chosen; `None` once the generation has stopped.
    /// The caller holds the program's state lock.
    pub fn next_token(&mut self, py: Python<'_>) -> RtResult<Option<i64>> {
        if self.done {
            return Ok(None);
        }
        let logits = if self.prefill_at_once && self.pending.len() > 1 {
            let tokens: Vec<i64> = self.pending.drain(..).collect();
            self.step_many(py, &tokens)?
        } else {
            loop {
                let token = self.pending.pop_front().ok_or_else(|| RtError::Internal("no token to feed".into()))?;
                let logits = self.step_one(py, token)?;
                if self.pending.is_empty() {
                    break logits;
                }
            }
        };
        // Greedy on a device: the argmax runs there and only the token comes back. Sampling
        // reads the row on the CPU, for the same seeded draws wherever the program runs.
        let token = match (self.sampling.do_sample, self.ids_ptr) {
            (false, None) => device_argmax(py, &logits)?,
            _ => self.sampling.choose(&last_row(py, &logits)?) as i64,
        };
        self.tokens.push(token);
        self.new_tokens += 1;
        self.pending.push_back(token);
        self.done = self.new_tokens >= self.stop.max_new_tokens || self.stop.eos.contains(&token);
        Ok(Some(token))
    }

    /// Feeds one token at the next position; returns the logits.
    fn step_one<'py>(&mut self, py: Python<'py>, token: i64) -> RtResult<Bound<'py, PyAny>> {
        let position = self.position;
        for (leaf, ptr, value) in [(self.ids, self.ids_ptr, token), (self.pos, self.pos_ptr, position)] {
            match ptr {
                // SAFETY: the tensor is this generation's own one-element int64 CPU tensor,
                // made in `new` and never handed out; the step only reads it.
                Some(address) => unsafe { *(address as *mut i64) = value },
                None => {
                    self.leaves[leaf].bind(py).call_method1(pyo3::intern!(py, "fill_"), (value,))?;
                }
            }
        }
        self.position += 1;
        let leaves: Vec<Bound<'py, PyAny>> = self.leaves.iter().map(|l| l.bind(py).clone()).collect();
        self.logits(py, &leaves)
    }

    /// Feeds several tokens at once from the next position (a prefill); returns the logits.
    fn step_many<'py>(&mut self, py: Python<'py>, tokens: &[i64]) -> RtResult<Bound<'py, PyAny>> {
        let torch = py.import("torch")?;
        let device = self.step.get().file().placement.target.clone();
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", torch.getattr("long")?)?;
        kwargs.set_item("device", device)?;
        let ids = torch.getattr("tensor")?.call((vec![tokens.to_vec()],), Some(&kwargs))?;
        let start = self.position;
        let positions: Vec<i64> = (start..start + tokens.len() as i64).collect();
        let pos = torch.getattr("tensor")?.call((positions,), Some(&kwargs))?;
        self.position += tokens.len() as i64;
        let mut leaves: Vec<Bound<'py, PyAny>> = self.leaves.iter().map(|l| l.bind(py).clone()).collect();
        leaves[self.ids] = ids;
        leaves[self.pos] = pos;
        self.logits(py, &leaves)
    }

    fn logits<'py>(&self, py: Python<'py>, leaves: &[Bound<'py, PyAny>]) -> RtResult<Bound<'py, PyAny>> {
        let outputs = Method::run_leaves(self.step.bind(py), leaves)?;
        outputs.into_iter().next().ok_or_else(|| RtError::Internal("the step returned nothing".into()))
    }

    /// The method each step runs.
    pub fn step(&self) -> &Py<Method> {
        &self.step
    }
}

/// The last position's logits of a `[1, n, vocab]` (or `[n, vocab]`) tensor, as f32.
fn last_row(py: Python<'_>, logits: &Bound<'_, PyAny>) -> RtResult<Vec<f32>> {
    let shape: Vec<i64> = logits.getattr(pyo3::intern!(py, "shape"))?.extract()?;
    let Some(&vocab) = shape.last() else {
        return Err(PyValueError::new_err("generate(): the step returned a scalar, not logits").into());
    };
    let flat = logits.call_method1(pyo3::intern!(py, "reshape"), (-1, vocab))?;
    let row = flat.get_item(-1)?;
    // `to` and `contiguous` return the tensor itself where it already is a contiguous CPU
    // float32 row (the usual case): no copy.
    let float32 = py.import("torch")?.getattr(pyo3::intern!(py, "float32"))?;
    let row = row.call_method1(pyo3::intern!(py, "to"), ("cpu", float32))?;
    let row = row.call_method0(pyo3::intern!(py, "contiguous"))?;
    let address: usize = row.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?;
    let n = usize::try_from(vocab).map_err(|_| RtError::Internal("negative vocabulary size".into()))?;
    // SAFETY: `row` is a contiguous CPU float32 tensor of `n` elements, alive for this read.
    let values = unsafe { std::slice::from_raw_parts(address as *const f32, n) }.to_vec();
    drop(row);
    Ok(values)
}

/// The index of the last position's largest logit, computed where the logits are (torch's
/// `argmax` takes the first of equals and counts NaN largest, as [`argmax`] does).
fn device_argmax(py: Python<'_>, logits: &Bound<'_, PyAny>) -> RtResult<i64> {
    let shape: Vec<i64> = logits.getattr(pyo3::intern!(py, "shape"))?.extract()?;
    let Some(&vocab) = shape.last() else {
        return Err(PyValueError::new_err("generate(): the step returned a scalar, not logits").into());
    };
    let row = logits.call_method1(pyo3::intern!(py, "reshape"), (-1, vocab))?.get_item(-1)?;
    Ok(row.call_method0(pyo3::intern!(py, "argmax"))?.call_method0(pyo3::intern!(py, "item"))?.extract()?)
}

/// The tokens of a `[1, n]` LongTensor (or a list of ints).
pub fn prompt_tokens(input_ids: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(list) = input_ids.cast::<PyList>() {
        return list.extract();
    }
    let shape: Vec<i64> = input_ids.getattr("shape")?.extract()?;
    if shape.len() != 2 || shape[0] != 1 {
        return Err(PyValueError::new_err(format!(
            "input_ids: expected a LongTensor of shape [1, n] (one sequence), got shape {shape:?}"
        )));
    }
    input_ids.call_method0("flatten")?.call_method0("tolist")?.extract()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(do_sample: bool, temperature: f64, top_k: usize, top_p: f64) -> Sampling {
        Sampling::new(do_sample, temperature, top_k, top_p, Some(7)).unwrap()
    }

    #[test]
    fn greedy_takes_the_first_largest() {
        assert_eq!(sampling(false, 1.0, 50, 1.0).choose(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[1.0, f32::NAN, 5.0]), 1);
    }

    #[test]
    fn top_k_and_top_p_keep_only_likely_tokens() {
        let logits = [5.0, 4.0, 0.0, -1.0, -2.0];
        let mut s = sampling(true, 1.0, 2, 1.0);
        assert!((0..500).all(|_| s.choose(&logits) < 2));
        // The first token holds ~73% of the mass: top_p=0.5 keeps it alone.
        let mut s = sampling(true, 1.0, 0, 0.5);
        assert!((0..500).all(|_| s.choose(&logits) == 0));
        // A high temperature flattens: every token comes up.
        let mut s = sampling(true, 100.0, 0, 1.0);
        let mut seen = [false; 5];
        (0..2000).for_each(|_| seen[s.choose(&logits)] = true);
        assert_eq!(seen, [true; 5]);
    }

    #[test]
    fn a_seed_gives_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = || {
            let mut s = sampling(true, 0.8, 10, 0.9);
            (0..20).map(|_| s.choose(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn refuses_bad_settings() {
        assert!(Sampling::new(true, 0.0, 50, 1.0, None).is_err());
        assert!(Sampling::new(false, 1.0, 50, 0.0, None).is_err());
    }
}
