//! The per-process record of which kernel won for a node: kwexport's or the other one
//! (torch's, oneDNN's), per number of rows (or pixels) and thread count, and the runs of the
//! keys still being measured (`exec::choose` runs and times them).

/// Which kernel won for each number of rows (or pixels) and thread count a node has seen (the
/// key `exec::choose` makes of both), per process, and the trials of the keys still being
/// measured.
pub struct Choices {
    /// Each `rows * 2 + (1 if kwexport's kernel won)`, or -1 for a free slot: atomics read
    /// with plain loads, so threads calling one program share them without contending (a
    /// lock here would bounce between cores on every node).
    slots: [std::sync::atomic::AtomicI64; 16],
    /// The keys being measured, over the program's first calls: locked only until a key is
    /// chosen.
    trials: std::sync::Mutex<Vec<Trial>>,
}

/// A key's measurements so far: the fastest run of each kernel (kwexport's first) and how
/// many runs each had.
#[derive(Debug, Clone, Copy)]
struct Trial {
    rows: i64,
    best: [std::time::Duration; 2],
    runs: [u32; 2],
}

/// How many calls each kernel runs, in turn, before a key is chosen.
pub const TRIAL_RUNS: u32 = 5;

impl std::fmt::Debug for Choices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Choices").finish_non_exhaustive()
    }
}

impl Default for Choices {
    fn default() -> Self {
        Choices {
            slots: std::array::from_fn(|_| std::sync::atomic::AtomicI64::new(-1)),
            trials: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl Choices {
    /// The choice made for `rows`, if one was.
    pub(crate) fn choice(&self, rows: i64) -> Option<bool> {
        use std::sync::atomic::Ordering::Relaxed;
        self.slots.iter().map(|c| c.load(Relaxed)).find(|&c| c >= 0 && c / 2 == rows).map(|c| c % 2 == 1)
    }

    /// Records a choice; returns false where every slot is taken (the caller keeps torch's).
    pub(crate) fn record(&self, rows: i64, ours: bool) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let code = rows * 2 + ours as i64;
        self.slots.iter().any(|c| c.compare_exchange(-1, code, Relaxed, Relaxed).is_ok() || c.load(Relaxed) == code)
    }

    /// Whether the next trial run for `rows` is kwexport's kernel's (the one with fewer runs
    /// so far, kwexport's first).
    pub(crate) fn next_is_ours(&self, rows: i64) -> bool {
        let trials = self.trials.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        trials.iter().find(|t| t.rows == rows).is_none_or(|t| t.runs[0] <= t.runs[1])
    }

    /// Adds a run of one kernel (`ours`) that took `took`; once each kernel has had
    /// [`TRIAL_RUNS`], `decide` picks from the two fastest (kwexport's, the other's) and
    /// the choice is recorded. Returns the choice where it was made now.
    pub(crate) fn add_run(
        &self,
        rows: i64,
        ours: bool,
        took: std::time::Duration,
        decide: impl Fn(std::time::Duration, std::time::Duration) -> bool,
    ) -> Option<bool> {
        let mut trials = self.trials.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = match trials.iter().position(|t| t.rows == rows) {
            Some(i) => i,
            None => {
                let fresh = Trial { rows, best: [std::time::Duration::MAX; 2], runs: [0; 2] };
                trials.push(fresh);
                trials.len() - 1
            }
        };
        let t = &mut trials[i];
        let k = usize::from(!ours);
        (t.best[k], t.runs[k]) = (t.best[k].min(took), t.runs[k] + 1);
        if t.runs.iter().any(|&r| r < TRIAL_RUNS) {
            return None;
        }
        let won = decide(t.best[0], t.best[1]);
        trials.swap_remove(i);
        Some(self.record(rows, won) && won)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn the_kernels_take_turns_then_the_fastest_runs_decide() {
        let c = Choices::default();
        let faster = |ours: Duration, theirs: Duration| ours < theirs;
        // kwexport's kernel first, then whichever has had fewer runs.
        let mut turns = Vec::new();
        for i in 0..2 * TRIAL_RUNS {
            let ours = c.next_is_ours(7);
            turns.push(ours);
            // kwexport's kernel runs 5 ms but once 2; the other one 3 ms.
            let took = if ours {
                if i == 2 {
                    ms(2)
                } else {
                    ms(5)
                }
            } else {
                ms(3)
            };
            let made = c.add_run(7, ours, took, faster);
            assert_eq!(made, (i + 1 == 2 * TRIAL_RUNS).then_some(true), "run {i}");
        }
        let alternate: Vec<bool> = (0..2 * TRIAL_RUNS).map(|i| i % 2 == 0).collect();
        assert_eq!(turns, alternate);
        assert_eq!(c.choice(7), Some(true), "the fastest run of each counts");
        assert_eq!(c.choice(8), None, "another key is measured apart");
    }

    #[test]
    fn keys_are_measured_apart_and_a_loss_is_recorded() {
        let c = Choices::default();
        let faster = |ours: Duration, theirs: Duration| ours < theirs;
        for _ in 0..TRIAL_RUNS {
            for key in [1, 2] {
                assert_eq!(c.add_run(key, true, ms(key as u64 * 2), faster), None);
            }
        }
        for _ in 1..TRIAL_RUNS {
            assert_eq!(c.add_run(1, false, ms(1), faster), None, "each kernel needs its runs");
        }
        assert_eq!(c.add_run(1, false, ms(1), faster), Some(false));
        assert_eq!((c.choice(1), c.choice(2)), (Some(false), None));
        assert!(!c.next_is_ours(2), "key 2 has had kwexport's runs only");
    }
}
