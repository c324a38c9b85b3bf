//! Input checks: the shape of every tensor leaf of a call against what was exported,
//! before anything runs: static sizes, symbol ranges, dims shared between inputs, derived
//! dims such as `2 * d`. The runtime reads each leaf's dtype, device and shape from Python
//! and hands the shape to a [`Checker`].

use crate::error::{Error, Result, ShapeProblem};
use crate::schema::{self, Dim};

/// A validated symbolic size: unique name, non-empty range.
#[derive(Debug, Clone, PartialEq)]
pub struct Symbol {
    /// Its name, as torch.export named it.
    pub name: String,
    /// Smallest value.
    pub min: i64,
    /// Largest value; `None` if unbounded.
    pub max: Option<i64>,
}

/// What one dimension of an input must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DimCheck {
    /// This size.
    Static(i64),
    /// `coeff * symbols[symbol] + offset`.
    Symbolic {
        /// Index into the program's symbols.
        symbol: usize,
        /// Multiplier, positive.
        coeff: i64,
        /// Offset.
        offset: i64,
    },
}

/// The checks of one call: the program's symbols and leaf paths, and the value each symbol
/// took so far in this call (with the leaf and dim where it was first seen).
pub struct Checker<'a> {
    symbols: &'a [Symbol],
    leaf_paths: &'a [String],
    seen: Vec<Option<(i64, usize, usize)>>,
}

impl<'a> Checker<'a> {
    /// A checker for one call.
    pub fn new(symbols: &'a [Symbol], leaf_paths: &'a [String]) -> Self {
        Checker { symbols, leaf_paths, seen: vec![None; symbols.len()] }
    }

    /// The path of leaf `leaf`, for messages.
    pub fn leaf_path(&self, leaf: usize) -> &str {
        &self.leaf_paths[leaf]
    }

    /// Every leaf's path: borrowed for as long as the checker's tables, not the checker.
    pub fn leaf_paths(&self) -> &'a [String] {
        self.leaf_paths
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
    let err = |problem| Error::Shape { path: path.clone(), problem: Box::new(problem) };
    if dims.len() != shape.len() {
        return Err(err(ShapeProblem::Rank { expected: dims.len(), shape: shape.to_vec() }));
    }
    for (i, (dim, &size)) in dims.iter().zip(shape).enumerate() {
        match *dim {
            DimCheck::Static(n) if n != size => {
                return Err(err(ShapeProblem::Static { dim: i, expected: n, size, shape: shape.to_vec() }));
            }
            DimCheck::Static(_) => {}
            DimCheck::Symbolic { symbol, coeff, offset } => {
                let sym = &symbols[symbol];
                let expr = render(&sym.name, coeff, offset);
                if let Some((value, at_leaf, at_dim)) = seen[symbol] {
                    let want = coeff * value + offset;
                    if want != size {
                        return Err(err(ShapeProblem::Inconsistent {
                            dim: i,
                            expr,
                            want,
                            symbol: sym.name.clone(),
                            value,
                            from_path: leaf_paths[at_leaf].clone(),
                            from_dim: at_dim,
                            size,
                        }));
                    }
                    continue;
                }
                let value = (size - offset) / coeff;
                if coeff * value + offset != size {
                    return Err(err(ShapeProblem::Unreachable { dim: i, expr, size }));
                }
                if value < enforced_min(sym.min) || sym.max.is_some_and(|m| value > m) {
                    let range = match sym.max {
                        Some(m) => format!("[{}, {m}]", sym.min),
                        None => format!("[{}, inf)", sym.min),
                    };
                    let got = if expr == sym.name {
                        format!("got {size}")
                    } else {
                        format!("got {size}, so {} = {value}", sym.name)
                    };
                    return Err(err(ShapeProblem::OutOfRange { dim: i, expr, symbol: sym.name.clone(), range, got }));
                }
                seen[symbol] = Some((value, leaf, i));
            }
        }
    }
    Ok(())
}

/// The lower bound a call is held to: a symbol's `min` where it is above 2, else none.
/// torch.export records 2 for a dimension it assumed was not 0 or 1 while tracing (its 0/1
/// specialization), and `ep.module()` accepts 0 and 1 there; so does kwexport. A bound the
/// user set above 2 holds.
pub fn enforced_min(min: i64) -> i64 {
    if min > 2 {
        min
    } else {
        0
    }
}

/// `coeff*name + offset` as kwexport prints it: `s0`, `2*s0`, `s0 - 1`.
pub fn render(name: &str, coeff: i64, offset: i64) -> String {
    let base = if coeff == 1 { name.to_owned() } else { format!("{coeff}*{name}") };
    match offset {
        0 => base,
        o if o > 0 => format!("{base} + {o}"),
        o => format!("{base} - {}", -o),
    }
}

/// Validates the symbol table.
pub fn symbols(raw: &[schema::Symbol]) -> Result<Vec<Symbol>> {
    let mut out: Vec<Symbol> = Vec::with_capacity(raw.len());
    for (i, s) in raw.iter().enumerate() {
        if out.iter().any(|o| o.name == s.name) {
            return Err(Error::DuplicateSymbol { index: i, name: s.name.clone() });
        }
        if s.min < 0 || s.max.is_some_and(|m| m < s.min) {
            return Err(Error::SymbolRange { index: i, name: s.name.clone(), min: s.min, max: s.max });
        }
        out.push(Symbol { name: s.name.clone(), min: s.min, max: s.max });
    }
    Ok(out)
}

/// Validates an input leaf's shape against the symbol table; `what` names the leaf.
pub fn dims(shape: &[Dim], symbols: &[Symbol], what: &str) -> Result<Vec<DimCheck>> {
    shape
        .iter()
        .enumerate()
        .map(|(i, d)| match d {
            Dim::Static(n) if *n >= 0 => Ok(DimCheck::Static(*n)),
            Dim::Static(n) => Err(Error::NegativeSize { entry: what.to_owned(), dim: i, size: *n }),
            Dim::Symbolic { symbol, coeff, offset } => {
                let idx = symbols.iter().position(|s| &s.name == symbol).ok_or_else(|| Error::UnknownSymbol {
                    entry: what.to_owned(),
                    dim: i,
                    symbol: symbol.clone(),
                })?;
                if *coeff <= 0 || coeff.checked_mul(1 << 32).is_none() || offset.abs() > (1 << 40) {
                    return Err(Error::DimExpression {
                        entry: what.to_owned(),
                        dim: i,
                        coeff: *coeff,
                        symbol: symbol.clone(),
                        offset: *offset,
                    });
                }
                Ok(DimCheck::Symbolic { symbol: idx, coeff: *coeff, offset: *offset })
            }
        })
        .collect()
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
    fn zero_and_one_pass_a_lower_bound_of_two() {
        // torch's 0/1 specialization: ep.module() enforces a lower bound only above 2.
        run(&[B], &[&[1]]).unwrap();
        run(&[B], &[&[0]]).unwrap();
        let paths = ["x0".to_owned()];
        let symbols = [Symbol { name: "n".into(), min: 3, max: None }];
        let err = Checker::new(&symbols, &paths).shape(&[B], &[2], 0).unwrap_err();
        assert_eq!(err.to_string(), "x0: dimension 0 is n with n in [3, inf), got 2");
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
