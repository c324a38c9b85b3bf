//! The signature binder: binds a call's positional and keyword arguments to the saved
//! signature exactly as CPython binds a call to a `def`, with CPython's error wording.
//!
//! Pure logic: it sees how many positional arguments came and the keyword names, and says
//! where each parameter's value comes from. The call path then fetches the objects.

use std::collections::HashMap;

use crate::error::{BindProblem, Error, ParamProblem, Result};
use crate::schema::{Param, ParamKind, Signature};

/// A signature that obeys Python's rules (checked once at load by [`Binder::new`]), ready
/// to bind calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Binder {
    /// How the callable names itself in messages.
    pub name: String,
    /// The parameters, in order.
    pub params: Vec<Param>,
    /// Parameters that can be filled by position: positional-only and positional-or-keyword.
    n_positional: usize,
    var_positional: Option<usize>,
    var_keyword: Option<usize>,
    by_name: HashMap<String, usize>,
}

/// Where a named parameter's value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The call's positional argument at this index.
    Positional(usize),
    /// The call's keyword argument at this index (of the keyword names passed to `bind`).
    Keyword(usize),
    /// The parameter's default.
    Default,
}

/// Where one parameter's value comes from; `bind` returns one per parameter, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Binding {
    /// A named parameter's value.
    One(Source),
    /// `*args`: these positional arguments, in order.
    VarPositional(std::ops::Range<usize>),
    /// `**kwargs`: these keyword arguments (indices into the call's keywords), in call order.
    VarKeyword(Vec<usize>),
}

impl Binder {
    /// Checks `sig` against Python's rules for a `def`.
    pub fn new(sig: &Signature) -> Result<Self> {
        let mut by_name = HashMap::new();
        let mut last_kind = ParamKind::PositionalOnly;
        let (mut var_positional, mut var_keyword, mut n_positional) = (None, None, 0);
        let mut seen_default = false;
        for (i, p) in sig.params.iter().enumerate() {
            let invalid = |problem| Error::InvalidParam { index: i, name: p.name.clone(), problem };
            if !is_identifier(&p.name) {
                return Err(invalid(ParamProblem::NotIdentifier));
            }
            if by_name.insert(p.name.clone(), i).is_some() {
                return Err(invalid(ParamProblem::DuplicateName));
            }
            if rank(p.kind) < rank(last_kind) {
                return Err(invalid(ParamProblem::Order { kind: p.kind, after: last_kind }));
            }
            last_kind = p.kind;
            match p.kind {
                ParamKind::PositionalOnly | ParamKind::PositionalOrKeyword => {
                    n_positional += 1;
                    if p.has_default() {
                        seen_default = true;
                    } else if seen_default {
                        return Err(invalid(ParamProblem::DefaultOrder));
                    }
                }
                ParamKind::VarPositional | ParamKind::VarKeyword => {
                    if p.has_default() {
                        return Err(invalid(ParamProblem::VariadicDefault));
                    }
                    let slot = if p.kind == ParamKind::VarPositional { &mut var_positional } else { &mut var_keyword };
                    if slot.replace(i).is_some() {
                        return Err(invalid(ParamProblem::SecondVariadic { kind: p.kind }));
                    }
                }
                ParamKind::KeywordOnly => {}
            }
        }
        Ok(Binder {
            name: sig.name.clone(),
            params: sig.params.clone(),
            n_positional,
            var_positional,
            var_keyword,
            by_name,
        })
    }

    /// How many parameters can be filled by position.
    pub fn n_positional(&self) -> usize {
        self.n_positional
    }
    /// The index of `*args`, if there is one.
    pub fn var_positional(&self) -> Option<usize> {
        self.var_positional
    }
    /// The index of `**kwargs`, if there is one.
    pub fn var_keyword(&self) -> Option<usize> {
        self.var_keyword
    }

    /// Binds a call with `n_args` positional arguments and the given keyword names.
    pub fn bind<S: AsRef<str>>(&self, n_args: usize, keywords: &[S]) -> Result<Vec<Binding>> {
        let mut bound: Vec<Option<Source>> = vec![None; self.params.len()];
        let mut var_kw = Vec::new();

        if n_args > self.n_positional && self.var_positional.is_none() {
            return Err(self.too_many_positional(n_args, keywords));
        }
        for (i, slot) in bound.iter_mut().enumerate().take(self.n_positional.min(n_args)) {
            *slot = Some(Source::Positional(i));
        }

        let mut posonly_as_kw = Vec::new();
        for (k, name) in keywords.iter().enumerate() {
            let name = name.as_ref();
            match self.by_name.get(name).map(|&i| (i, self.params[i].kind)) {
                Some((i, ParamKind::PositionalOrKeyword | ParamKind::KeywordOnly)) => {
                    if bound[i].is_some() {
                        return Err(self.err(BindProblem::MultipleValues(name.to_owned())));
                    }
                    bound[i] = Some(Source::Keyword(k));
                }
                found => {
                    if self.var_keyword.is_some() {
                        var_kw.push(k);
                    } else if matches!(found, Some((_, ParamKind::PositionalOnly))) {
                        posonly_as_kw.push(name.to_owned());
                    } else {
                        return Err(self.err(BindProblem::UnexpectedKeyword(name.to_owned())));
                    }
                }
            }
        }
        if !posonly_as_kw.is_empty() {
            return Err(self.err(BindProblem::PositionalOnlyByName(posonly_as_kw)));
        }

        let missing = |kind: fn(ParamKind) -> bool, bound: &[Option<Source>]| -> Vec<String> {
            self.params
                .iter()
                .zip(bound)
                .filter(|(p, b)| kind(p.kind) && b.is_none() && !p.has_default())
                .map(|(p, _)| p.name.clone())
                .collect()
        };
        let positional = missing(|k| matches!(k, ParamKind::PositionalOnly | ParamKind::PositionalOrKeyword), &bound);
        if !positional.is_empty() {
            return Err(self.err(BindProblem::Missing { kind: "positional", names: positional }));
        }
        let keyword_only = missing(|k| k == ParamKind::KeywordOnly, &bound);
        if !keyword_only.is_empty() {
            return Err(self.err(BindProblem::Missing { kind: "keyword-only", names: keyword_only }));
        }

        Ok(self
            .params
            .iter()
            .zip(bound)
            .map(|(p, b)| match p.kind {
                ParamKind::VarPositional => Binding::VarPositional(self.n_positional.min(n_args)..n_args),
                ParamKind::VarKeyword => Binding::VarKeyword(std::mem::take(&mut var_kw)),
                _ => Binding::One(b.unwrap_or(Source::Default)),
            })
            .collect())
    }

    fn err(&self, problem: BindProblem) -> Error {
        Error::Bind { function: self.name.clone(), problem }
    }

    fn too_many_positional<S: AsRef<str>>(&self, given: usize, keywords: &[S]) -> Error {
        let max = self.n_positional;
        let keyword_only_given = keywords
            .iter()
            .filter(|k| self.by_name.get(k.as_ref()).is_some_and(|&i| self.params[i].kind == ParamKind::KeywordOnly))
            .count();
        self.err(BindProblem::TooManyPositional {
            required: self.params[..max].iter().filter(|p| !p.has_default()).count(),
            max,
            given,
            keyword_only_given,
        })
    }
}

fn rank(k: ParamKind) -> u8 {
    match k {
        ParamKind::PositionalOnly => 0,
        ParamKind::PositionalOrKeyword => 1,
        ParamKind::VarPositional => 2,
        ParamKind::KeywordOnly => 3,
        ParamKind::VarKeyword => 4,
    }
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_alphabetic()) && chars.all(|c| c == '_' || c.is_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Constant;
    use crate::ErrorKind;
    use ParamKind::*;

    fn sig(params: &[(&str, ParamKind, bool)]) -> Binder {
        Binder::new(&Signature {
            name: "f".into(),
            params: params
                .iter()
                .map(|&(n, k, d)| Param {
                    name: n.into(),
                    kind: k,
                    default: d.then_some(Constant::Int(1)),
                    default_weight: None,
                })
                .collect(),
        })
        .unwrap()
    }

    fn err(s: &Binder, n: usize, kw: &[&str]) -> String {
        let e = s.bind(n, kw).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Signature, "{e:?}");
        e.to_string()
    }

    #[test]
    fn binds_every_parameter_kind() {
        let s = sig(&[
            ("a", PositionalOnly, false),
            ("b", PositionalOrKeyword, false),
            ("c", PositionalOrKeyword, true),
            ("rest", VarPositional, false),
            ("k", KeywordOnly, false),
            ("kd", KeywordOnly, true),
            ("kw", VarKeyword, false),
        ]);
        let b = s.bind(4, &["k", "zz"]).unwrap();
        assert_eq!(
            b,
            vec![
                Binding::One(Source::Positional(0)),
                Binding::One(Source::Positional(1)),
                Binding::One(Source::Positional(2)),
                Binding::VarPositional(3..4),
                Binding::One(Source::Keyword(0)),
                Binding::One(Source::Default),
                Binding::VarKeyword(vec![1]),
            ]
        );
        // Positional-or-keyword by name; a positional-only name goes to **kw when there is one.
        let b = s.bind(1, &["a", "b", "k"]).unwrap();
        assert_eq!(b[1], Binding::One(Source::Keyword(1)));
        assert_eq!(b[6], Binding::VarKeyword(vec![0]));
    }

    #[test]
    fn words_errors_as_cpython() {
        let s =
            sig(&[("x", PositionalOrKeyword, false), ("y", PositionalOrKeyword, false), ("cfg", KeywordOnly, false)]);
        assert_eq!(err(&s, 3, &[]), "f() takes 2 positional arguments but 3 were given");
        assert_eq!(
            err(&s, 3, &["cfg"]),
            "f() takes 2 positional arguments but 3 positional arguments (and 1 keyword-only argument) were given"
        );
        assert_eq!(err(&s, 2, &[]), "f() missing 1 required keyword-only argument: 'cfg'");
        assert_eq!(err(&s, 2, &["cfgg"]), "f() got an unexpected keyword argument 'cfgg'");
        assert_eq!(err(&s, 1, &["x", "cfg"]), "f() got multiple values for argument 'x'");
        assert_eq!(err(&s, 0, &["cfg"]), "f() missing 2 required positional arguments: 'x' and 'y'");
        let s3 =
            sig(&[("a", PositionalOnly, false), ("b", PositionalOrKeyword, false), ("c", PositionalOrKeyword, true)]);
        assert_eq!(err(&s3, 0, &[]), "f() missing 2 required positional arguments: 'a' and 'b'");
        assert_eq!(err(&s3, 4, &[]), "f() takes from 2 to 3 positional arguments but 4 were given");
        assert_eq!(err(&s3, 1, &["a", "b"]), "f() got some positional-only arguments passed as keyword arguments: 'a'");
        let one = sig(&[("x", PositionalOrKeyword, false)]);
        assert_eq!(err(&one, 2, &[]), "f() takes 1 positional argument but 2 were given");
        let none = sig(&[]);
        assert_eq!(err(&none, 1, &[]), "f() takes 0 positional arguments but 1 was given");
        let three = sig(&[("a", KeywordOnly, false), ("b", KeywordOnly, false), ("c", KeywordOnly, false)]);
        assert_eq!(err(&three, 0, &[]), "f() missing 3 required keyword-only arguments: 'a', 'b', and 'c'");
    }

    #[test]
    fn rejects_invalid_signatures() {
        let bad = |params: Vec<Param>| Binder::new(&Signature { name: "f".into(), params }).unwrap_err().to_string();
        let p = |n: &str, k, d: bool| Param {
            name: n.into(),
            kind: k,
            default: d.then_some(Constant::Int(0)),
            default_weight: None,
        };
        assert!(bad(vec![p("a", KeywordOnly, false), p("b", PositionalOrKeyword, false)]).contains("cannot follow"));
        assert!(bad(vec![p("a", PositionalOrKeyword, false), p("a", KeywordOnly, false)]).contains("duplicate"));
        assert!(bad(vec![p("a", PositionalOrKeyword, true), p("b", PositionalOrKeyword, false)])
            .contains("without a default"));
        assert!(bad(vec![p("a b", PositionalOrKeyword, false)]).contains("identifier"));
        assert!(bad(vec![p("a", VarPositional, false), p("b", VarPositional, false)]).contains("second"));
    }
}
