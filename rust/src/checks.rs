//! Input checks: every leaf of a call against what was exported, before anything runs.
//!
//! The shape logic (static sizes, symbol ranges, dims shared between inputs, derived dims
//! such as `2 * d`) is pure; `LeafCheck::check` applies it to a Python object.

use pyo3::prelude::*;

use crate::artifact;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::schema::{self, Dim, LeafSpec};
use crate::treespec::describe;

#[derive(Debug, Clone, PartialEq)]
pub struct Symbol {
    pub name: String,
    pub min: i64,
    pub max: Option<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DimCheck {
    Static(i64),
    Symbolic { symbol: usize, coeff: i64, offset: i64 },
}

/// The checks of one call: the program's symbols and leaf paths, and the value each symbol
/// took so far in this call (with the leaf and dim where it was first seen).
pub struct Checker<'a> {
    symbols: &'a [Symbol],
    leaf_paths: &'a [String],
    seen: Vec<Option<(i64, usize, usize)>>,
}

impl<'a> Checker<'a> {
    pub fn new(symbols: &'a [Symbol], leaf_paths: &'a [String]) -> Self {
        Checker { symbols, leaf_paths, seen: vec![None; symbols.len()] }
    }

    /// Checks the sizes of leaf `leaf`.
    pub fn shape(&mut self, dims: &[DimCheck], shape: &[i64], leaf: usize) -> Result<()> {
        check_shape(dims, shape, self.symbols, &mut self.seen, leaf, self.leaf_paths)
    }
}

fn check_shape(
    dims: &[DimCheck],
    shape: &[i64],
    symbols: &[Symbol],
    seen: &mut [Option<(i64, usize, usize)>],
    leaf: usize,
    leaf_paths: &[String],
) -> Result<()> {
    let path = &leaf_paths[leaf];
    if dims.len() != shape.len() {
        return Err(Error::Input(format!(
            "{path}: expected a tensor with {} dimension{}, got {} (shape {shape:?})",
            dims.len(),
            if dims.len() == 1 { "" } else { "s" },
            shape.len()
        )));
    }
    for (i, (dim, &size)) in dims.iter().zip(shape).enumerate() {
        match *dim {
            DimCheck::Static(n) if n != size => {
                return Err(Error::Input(format!(
                    "{path}: dimension {i} must be {n} (static at export), got {size} (shape {shape:?})"
                )));
            }
            DimCheck::Static(_) => {}
            DimCheck::Symbolic { symbol, coeff, offset } => {
                let sym = &symbols[symbol];
                let expr = render(&sym.name, coeff, offset);
                if let Some((value, at_leaf, at_dim)) = seen[symbol] {
                    let want = coeff * value + offset;
                    if want != size {
                        return Err(Error::Input(format!(
                            "{path}: dimension {i} is {expr} = {want}, since {} = {value} from {} dimension {at_dim}, got {size}",
                            sym.name, leaf_paths[at_leaf]
                        )));
                    }
                    continue;
                }
                let value = (size - offset) / coeff;
                if coeff * value + offset != size {
                    return Err(Error::Input(format!("{path}: dimension {i} is {expr}, which cannot be {size}")));
                }
                if value < sym.min || sym.max.is_some_and(|m| value > m) {
                    let range = match sym.max {
                        Some(m) => format!("[{}, {m}]", sym.min),
                        None => format!("[{}, inf)", sym.min),
                    };
                    let got = if expr == sym.name {
                        format!("got {size}")
                    } else {
                        format!("got {size}, so {} = {value}", sym.name)
                    };
                    return Err(Error::Input(format!(
                        "{path}: dimension {i} is {expr} with {} in {range}, {got}",
                        sym.name
                    )));
                }
                seen[symbol] = Some((value, leaf, i));
            }
        }
    }
    Ok(())
}

fn render(name: &str, coeff: i64, offset: i64) -> String {
    let base = if coeff == 1 { name.to_owned() } else { format!("{coeff}*{name}") };
    match offset {
        0 => base,
        o if o > 0 => format!("{base} + {o}"),
        o => format!("{base} - {}", -o),
    }
}

pub fn symbols(raw: &[schema::Symbol]) -> Result<Vec<Symbol>> {
    let mut out: Vec<Symbol> = Vec::with_capacity(raw.len());
    for (i, s) in raw.iter().enumerate() {
        if out.iter().any(|o| o.name == s.name) {
            return Err(artifact!("symbols[{i}]: duplicate symbol {:?}", s.name));
        }
        if s.min < 0 || s.max.is_some_and(|m| m < s.min) {
            return Err(artifact!("symbols[{i}] ({}): invalid range [{}, {:?}]", s.name, s.min, s.max));
        }
        out.push(Symbol { name: s.name.clone(), min: s.min, max: s.max });
    }
    Ok(out)
}

pub fn dims(shape: &[Dim], symbols: &[Symbol], what: &str) -> Result<Vec<DimCheck>> {
    shape
        .iter()
        .enumerate()
        .map(|(i, d)| match d {
            Dim::Static(n) if *n >= 0 => Ok(DimCheck::Static(*n)),
            Dim::Static(n) => Err(artifact!("{what}.shape[{i}]: negative size {n}")),
            Dim::Symbolic { symbol, coeff, offset } => {
                let idx = symbols
                    .iter()
                    .position(|s| &s.name == symbol)
                    .ok_or_else(|| artifact!("{what}.shape[{i}]: unknown symbol {symbol:?}"))?;
                if *coeff <= 0 || coeff.checked_mul(1 << 32).is_none() || offset.abs() > (1 << 40) {
                    return Err(artifact!("{what}.shape[{i}]: unsupported expression {coeff}*{symbol} + {offset}"));
                }
                Ok(DimCheck::Symbolic { symbol: idx, coeff: *coeff, offset: *offset })
            }
        })
        .collect()
}

/// A leaf's check with its Python objects resolved at load.
pub enum LeafCheck {
    Tensor { dtype: Py<PyAny>, dtype_name: &'static str, device: Py<PyAny>, device_name: String, dims: Vec<DimCheck> },
    Constant { value: Py<PyAny>, repr: String },
}

impl LeafCheck {
    pub fn new(
        py: Python<'_>,
        torch: &Bound<'_, PyModule>,
        spec: &LeafSpec,
        symbols: &[Symbol],
        what: &str,
    ) -> PyResult<Result<Self>> {
        Ok(Ok(match spec {
            LeafSpec::Tensor(t) => {
                let Some(dt) = DType::parse(&t.dtype) else {
                    return Ok(Err(artifact!("{what}: unsupported dtype {:?}", t.dtype)));
                };
                let dims = match dims(&t.shape, symbols, what) {
                    Ok(d) => d,
                    Err(e) => return Ok(Err(e)),
                };
                let device = match torch.getattr("device")?.call1((t.device.as_str(),)) {
                    Ok(d) => d,
                    Err(_) => return Ok(Err(artifact!("{what}: invalid device {:?}", t.device))),
                };
                LeafCheck::Tensor {
                    dtype: torch.getattr(dt.name)?.unbind(),
                    dtype_name: dt.name,
                    device_name: device.str()?.to_string(),
                    device: device.unbind(),
                    dims,
                }
            }
            LeafSpec::Constant(c) => {
                let value = crate::plan::constant_to_py(py, c)?;
                let repr = value.bind(py).repr()?.to_string();
                LeafCheck::Constant { value, repr }
            }
        }))
    }

    /// Checks `obj`, leaf `leaf` of a call.
    pub fn check(
        &self,
        obj: &Bound<'_, PyAny>,
        tensor_type: &Bound<'_, PyAny>,
        leaf: usize,
        checker: &mut Checker<'_>,
    ) -> Result<()> {
        let path = &checker.leaf_paths[leaf];
        let py_err = |e: PyErr| Error::Input(format!("{path}: {e}"));
        match self {
            LeafCheck::Tensor { dtype, dtype_name, device, device_name, dims } => {
                if !obj.is_instance(tensor_type).unwrap_or(false) {
                    return Err(Error::Input(format!(
                        "{path}: expected a tensor of dtype torch.{dtype_name}, got {}",
                        describe(obj)
                    )));
                }
                let got = obj.getattr(pyo3::intern!(obj.py(), "dtype")).map_err(py_err)?;
                if !got.is(dtype.bind(obj.py())) {
                    return Err(Error::Input(format!("{path}: expected dtype torch.{dtype_name}, got {got}")));
                }
                let got = obj.getattr(pyo3::intern!(obj.py(), "device")).map_err(py_err)?;
                if !got.eq(device.bind(obj.py())).map_err(py_err)? {
                    return Err(Error::Input(format!("{path}: expected a tensor on {device_name}, got one on {got}")));
                }
                let shape: Vec<i64> =
                    obj.getattr(pyo3::intern!(obj.py(), "shape")).and_then(|s| s.extract()).map_err(py_err)?;
                checker.shape(dims, &shape, leaf)
            }
            LeafCheck::Constant { value, repr } => {
                let value = value.bind(obj.py());
                let same = obj.get_type().is(value.get_type()) && obj.eq(value).unwrap_or(false);
                if same {
                    Ok(())
                } else {
                    let got = obj.repr().map(|r| r.to_string()).unwrap_or_else(|_| describe(obj));
                    Err(Error::Input(format!("{path}: expected {repr} (specialized at export), got {got}")))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn syms() -> Vec<Symbol> {
        vec![Symbol { name: "batch".into(), min: 2, max: Some(64) }, Symbol { name: "s1".into(), min: 2, max: None }]
    }

    fn run(dims: &[DimCheck], shapes: &[&[i64]]) -> Result<()> {
        let paths: Vec<String> = (0..shapes.len()).map(|i| format!("x{i}")).collect();
        let symbols = syms();
        let mut checker = Checker::new(&symbols, &paths);
        for (i, s) in shapes.iter().enumerate() {
            checker.shape(dims, s, i)?;
        }
        Ok(())
    }

    const B: DimCheck = DimCheck::Symbolic { symbol: 0, coeff: 1, offset: 0 };

    #[test]
    fn static_and_rank() {
        let d = [B, DimCheck::Static(4)];
        run(&d, &[&[3, 4]]).unwrap();
        assert_eq!(
            run(&d, &[&[3, 5]]).unwrap_err().to_string(),
            "x0: dimension 1 must be 4 (static at export), got 5 (shape [3, 5])"
        );
        assert_eq!(
            run(&d, &[&[3]]).unwrap_err().to_string(),
            "x0: expected a tensor with 2 dimensions, got 1 (shape [3])"
        );
    }

    #[test]
    fn ranges_and_equalities() {
        let d = [B];
        assert_eq!(
            run(&d, &[&[100]]).unwrap_err().to_string(),
            "x0: dimension 0 is batch with batch in [2, 64], got 100"
        );
        assert_eq!(
            run(&d, &[&[8], &[5]]).unwrap_err().to_string(),
            "x1: dimension 0 is batch = 8, since batch = 8 from x0 dimension 0, got 5"
        );
        run(&d, &[&[8], &[8]]).unwrap();
    }

    #[test]
    fn derived_dims() {
        let twice = [DimCheck::Symbolic { symbol: 0, coeff: 2, offset: 1 }];
        run(&twice, &[&[9]]).unwrap();
        assert_eq!(run(&twice, &[&[8]]).unwrap_err().to_string(), "x0: dimension 0 is 2*batch + 1, which cannot be 8");
        assert_eq!(
            run(&twice, &[&[201]]).unwrap_err().to_string(),
            "x0: dimension 0 is 2*batch + 1 with batch in [2, 64], got 201, so batch = 100"
        );
    }

    #[test]
    fn validates_specs() {
        let s = syms();
        assert!(dims(&[Dim::Static(-1)], &s, "inputs.leaves[0]").unwrap_err().to_string().contains("negative"));
        let unknown = Dim::Symbolic { symbol: "zz".into(), coeff: 1, offset: 0 };
        assert!(dims(&[unknown], &s, "l").unwrap_err().to_string().contains("unknown symbol"));
        let raw = [schema::Symbol { name: "a".into(), min: 5, max: Some(2) }];
        assert!(symbols(&raw).unwrap_err().to_string().contains("invalid range"));
    }
}
