//! Weights: the storage table, checked once at load. Storages are 64-aligned, in bounds
//! and disjoint; every tensor fits inside its storage. (The runtime then views them in the
//! mapped file without copying.)

use std::collections::BTreeMap;

use crate::container::{self, Layout};
use crate::error::{Error, Result};
use crate::schema::{WeightTensor, Weights};
use crate::tables::{DType, ALIGN};

/// A weight tensor that passed validation.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedWeight {
    /// Its element type.
    pub dtype: DType,
    /// Sizes.
    pub shape: Vec<i64>,
    /// Strides, in elements.
    pub strides: Vec<i64>,
    /// Index into `weights.storages`.
    pub storage: usize,
    /// In elements, from the storage's start.
    pub storage_offset: i64,
}

/// Validates the weight table against the data section; returns each tensor checked.
pub fn validate(weights: &Weights, layout: &Layout) -> Result<BTreeMap<String, CheckedWeight>> {
    let mut spans = Vec::with_capacity(weights.storages.len());
    for (i, s) in weights.storages.iter().enumerate() {
        let what = format!("weights.storages[{i}]");
        if s.offset % ALIGN != 0 {
            return Err(Error::UnalignedStorage { index: i, offset: s.offset, align: ALIGN });
        }
        let range = container::data_range(layout, s.offset, s.nbytes, &what)?;
        spans.push((range.start, range.end, i));
    }
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let ((_, a_end, a), (b_start, _, b)) = (pair[0], pair[1]);
        if b_start < a_end {
            return Err(Error::OverlappingStorages { first: a, second: b });
        }
    }
    weights.tensors.iter().map(|(name, t)| Ok((name.clone(), check_tensor(name, t, weights)?))).collect()
}

fn check_tensor(name: &str, t: &WeightTensor, weights: &Weights) -> Result<CheckedWeight> {
    let what = format!("weights.tensors[{name:?}]");
    let dtype = DType::parse(&t.dtype)
        .ok_or_else(|| Error::UnsupportedDtype { entry: what.clone(), dtype: t.dtype.clone() })?;
    let storage = weights.storages.get(t.storage).ok_or_else(|| Error::MissingStorage {
        entry: what.clone(),
        storage: t.storage,
        count: weights.storages.len(),
    })?;
    if t.shape.len() != t.strides.len() {
        return Err(Error::StrideRank { entry: what, shape: t.shape.len(), strides: t.strides.len() });
    }
    if storage.nbytes % dtype.itemsize != 0 {
        return Err(Error::StorageNotWhole {
            entry: what,
            storage: t.storage,
            nbytes: storage.nbytes,
            dtype: dtype.name,
        });
    }
    if t.shape.iter().any(|&d| d < 0) || t.strides.iter().any(|&s| s < 0) || t.storage_offset < 0 {
        return Err(Error::NegativeLayout { entry: what });
    }
    // The furthest element, in elements: offset + sum((size - 1) * stride); none if empty.
    let overflow = || Error::LayoutOverflow { entry: what.clone(), shape: t.shape.clone(), strides: t.strides.clone() };
    let extent = if t.shape.contains(&0) {
        0
    } else {
        let mut last = t.storage_offset as u64;
        for (&size, &stride) in t.shape.iter().zip(&t.strides) {
            let step = (size as u64 - 1).checked_mul(stride as u64).ok_or_else(overflow)?;
            last = last.checked_add(step).ok_or_else(overflow)?;
        }
        last.checked_add(1).ok_or_else(overflow)?
    };
    let needed = extent.checked_mul(dtype.itemsize).ok_or_else(overflow)?;
    if needed > storage.nbytes {
        return Err(Error::StorageTooSmall { entry: what, needed, storage: t.storage, nbytes: storage.nbytes });
    }
    Ok(CheckedWeight {
        dtype,
        shape: t.shape.clone(),
        strides: t.strides.clone(),
        storage: t.storage,
        storage_offset: t.storage_offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Storage;

    fn layout(data_len: usize) -> Layout {
        Layout { header: 16..20, data: 64..64 + data_len }
    }

    fn weights(storages: Vec<(u64, u64)>, t: WeightTensor) -> Weights {
        Weights {
            storages: storages.into_iter().map(|(offset, nbytes)| Storage { offset, nbytes }).collect(),
            tensors: [("w".to_owned(), t)].into(),
        }
    }

    fn t(shape: Vec<i64>, strides: Vec<i64>, storage_offset: i64) -> WeightTensor {
        WeightTensor { dtype: "float32".into(), shape, strides, storage: 0, storage_offset, mutable: false }
    }

    #[test]
    fn accepts_views_within_storage() {
        let w = weights(vec![(0, 48)], t(vec![3, 2], vec![1, 3], 6));
        assert!(validate(&w, &layout(64)).is_ok());
        let w = weights(vec![(0, 0)], t(vec![0, 5], vec![5, 1], 0));
        assert!(validate(&w, &layout(0)).is_ok());
    }

    #[test]
    fn rejects_out_of_bounds_and_overlap() {
        let msg = |w: Weights, n| validate(&w, &layout(n)).unwrap_err().to_string();
        assert!(msg(weights(vec![(0, 48)], t(vec![3, 4], vec![4, 1], 1)), 64).contains("needs 52 bytes"));
        assert!(msg(weights(vec![(64, 48)], t(vec![1], vec![1], 0)), 64).contains("outside"));
        assert!(msg(weights(vec![(3, 4)], t(vec![1], vec![1], 0)), 64).contains("aligned"));
        assert!(msg(weights(vec![(0, 128), (64, 64)], t(vec![1], vec![1], 0)), 256).contains("overlap"));
        assert!(msg(weights(vec![(0, 8)], t(vec![i64::MAX, 2], vec![i64::MAX, 1], 0)), 64).contains("overflow"));
        assert!(msg(weights(vec![(0, 8)], t(vec![-1], vec![1], 0)), 64).contains("negative"));
        let mut bad = t(vec![1], vec![1], 0);
        bad.storage = 5;
        assert!(msg(weights(vec![(0, 8)], bad), 64).contains("does not exist"));
    }
}
