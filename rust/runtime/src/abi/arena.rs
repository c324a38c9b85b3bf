//! The arena kwexport's kernels write their CPU outputs to.
//!
//! torch's CPU allocator is glibc's `malloc`, which hands large blocks back to the kernel
//! (or trims the heap's top) when they are freed: the next call's outputs then fault in page
//! by page, which cost GhostNet 1.7× its call. Serving calls the same program with the same
//! shapes again and again, so the outputs of kwexport's own kernels come from this arena
//! instead: a tensor is made over a block with `torch_from_blob`, and torch's deleter (run
//! when the last tensor or view over it goes, on any thread) frees the block. ONNX Runtime's
//! and OpenVINO's arenas do the same for every activation.
//!
//! The arena is `malloc`'s design without the giving back: large slabs, split by best fit,
//! freed blocks merged with their free neighbours, so that the next output lands in memory
//! just freed and still in cache (a cache of whole buffers per size kept far more memory
//! live and ran MobileNetV2 8% slower). Slabs are never returned; the arena grows to at most
//! [`limit`] bytes, beyond which outputs come from torch's allocator.

use std::alloc::Layout;
use std::cell::UnsafeCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Once, OnceLock};

/// Blocks start on 64 bytes, as torch's CPU allocator aligns; kernels assume no more.
const ALIGN: usize = 64;
/// Below this `malloc` serves blocks from its bins without touching the kernel.
pub const MIN_BYTES: usize = 64 << 10;
/// A slab's size: pages are only committed as blocks in them are first written.
const SLAB: usize = 64 << 20;

/// The arena's bound: `KWEXPORT_ARENA_MB` (0 turns it off), 4 GiB by default.
pub fn limit() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("KWEXPORT_ARENA_MB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .map_or(4 << 30, |mb| mb.saturating_mul(1 << 20))
    })
}

thread_local! {
    /// Set while a node whose output goes to the caller runs (`outside`).
    static OUTSIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with this thread's outputs from torch's allocator instead: a program's outputs,
/// which the caller owns, keep a storage torch can resize (`resize_`, an `out=` argument),
/// as eager's do; a tensor over an arena block can't be resized.
pub fn outside<R>(f: impl FnOnce() -> R) -> R {
    let before = OUTSIDE.with(|o| o.replace(true));
    let result = f();
    OUTSIDE.with(|o| o.set(before));
    result
}

/// Whether an output made on this thread now may come from the arena.
pub fn here() -> bool {
    !OUTSIDE.with(std::cell::Cell::get)
}

struct Arena {
    /// Free blocks by address (for merging) and by size (for best fit).
    by_addr: BTreeMap<usize, usize>,
    by_size: BTreeSet<(usize, usize)>,
    /// Where each slab starts: blocks never merge across one.
    slab_starts: BTreeSet<usize>,
    reserved: usize,
}

impl Arena {
    const fn new() -> Arena {
        Arena { by_addr: BTreeMap::new(), by_size: BTreeSet::new(), slab_starts: BTreeSet::new(), reserved: 0 }
    }

    fn insert(&mut self, addr: usize, size: usize) {
        self.by_addr.insert(addr, size);
        self.by_size.insert((size, addr));
    }

    fn remove(&mut self, addr: usize) -> Option<usize> {
        let size = self.by_addr.remove(&addr)?;
        self.by_size.remove(&(size, addr));
        Some(size)
    }

    /// The smallest free block of at least `size` bytes, split to `size`.
    fn best_fit(&mut self, size: usize) -> Option<usize> {
        let &(found, addr) = self.by_size.range((size, 0)..).next()?;
        self.remove(addr);
        if found > size {
            self.insert(addr + size, found - size);
        }
        Some(addr)
    }

    /// Frees a block, merged with the free blocks beside it in its slab.
    fn free(&mut self, mut addr: usize, mut size: usize) {
        let next = addr + size;
        if !self.slab_starts.contains(&next) {
            if let Some(n) = self.remove(next) {
                size += n;
            }
        }
        if !self.slab_starts.contains(&addr) {
            if let Some((&prev, &p)) = self.by_addr.range(..addr).next_back() {
                if prev + p == addr {
                    self.remove(prev);
                    (addr, size) = (prev, size + p);
                }
            }
        }
        self.insert(addr, size);
    }
}

/// The process's arena behind a flag, not a `Mutex`, so that `fork()` can't copy it
/// half-updated or held: a handler takes the flag before every fork and releases it after,
/// in the parent and in the child (glibc's `malloc` guards its arenas the same way), where a
/// `Mutex` another thread held at the fork would stay held in the child forever. Critical
/// sections are a few tree operations, so waiting spins, yielding.
struct Shared {
    busy: AtomicBool,
    arena: UnsafeCell<Arena>,
}

// SAFETY: `arena` is only reached through `Held`, which exists only while `busy` is set by it.
unsafe impl Sync for Shared {}

static ARENA: Shared = Shared { busy: AtomicBool::new(false), arena: UnsafeCell::new(Arena::new()) };

fn acquire() {
    while ARENA.busy.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        std::thread::yield_now();
    }
}

extern "C" fn release() {
    ARENA.busy.store(false, Ordering::Release);
}

extern "C" fn before_fork() {
    acquire();
}

/// The arena, held until dropped.
struct Held;

impl std::ops::Deref for Held {
    type Target = Arena;
    fn deref(&self) -> &Arena {
        // SAFETY: this `Held` set `busy`; no other reference exists until it is dropped.
        unsafe { &*ARENA.arena.get() }
    }
}

impl std::ops::DerefMut for Held {
    fn deref_mut(&mut self) -> &mut Arena {
        // SAFETY: as for `deref`.
        unsafe { &mut *ARENA.arena.get() }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        release();
    }
}

fn arena() -> Held {
    static AT_FORK: Once = Once::new();
    AT_FORK.call_once(|| {
        // SAFETY: handlers that only set and clear an atomic flag.
        unsafe { libc::pthread_atfork(Some(before_fork), Some(release), Some(release)) };
    });
    acquire();
    Held
}

/// The size of the block a request of `bytes` takes.
pub fn block_size(bytes: usize) -> usize {
    bytes.max(1).div_ceil(ALIGN) * ALIGN
}

/// A block of [`block_size`]`(bytes)` bytes, and that size; `None` where the arena would pass
/// its [`limit`] or the slab's allocation fails.
pub fn take(bytes: usize) -> Option<(*mut c_void, usize)> {
    let size = block_size(bytes);
    let mut a = arena();
    if let Some(addr) = a.best_fit(size) {
        return Some((addr as *mut c_void, size));
    }
    let slab = size.max(SLAB.min(limit()));
    if a.reserved + slab > limit() {
        return None;
    }
    // SAFETY: a non-zero size and a power-of-two alignment. Never deallocated: the arena
    // keeps its slabs for the process's life.
    let start = unsafe { std::alloc::alloc(Layout::from_size_align(slab, ALIGN).ok()?) } as usize;
    if start == 0 {
        return None;
    }
    a.reserved += slab;
    a.slab_starts.insert(start);
    if slab > size {
        a.insert(start + size, slab - size);
    }
    Some((start as *mut c_void, size))
}

/// torch's deleter for a tensor made over an arena block: `ctx` carries the block's size.
///
/// # Safety
/// `data` must be a block [`take`] gave with size `ctx as usize`, not freed since, and
/// nothing may use it after.
pub unsafe extern "C" fn give_back(data: *mut c_void, ctx: *mut c_void) {
    arena().free(data as usize, ctx as usize);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The tests of the process's arena, one at a time (each checks what it holds).
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    /// The arena's bookkeeping on addresses alone: best fit, splitting, merging with both
    /// neighbours, and never across a slab's start.
    #[test]
    fn best_fit_splits_and_frees_merge() {
        let mut a = Arena::new();
        a.slab_starts.insert(1000);
        a.slab_starts.insert(2000);
        a.insert(1000, 1000);
        a.insert(2000, 1000);
        assert_eq!(a.best_fit(100), Some(1000));
        assert_eq!(a.best_fit(200), Some(1100));
        assert_eq!(a.best_fit(700), Some(1300), "the rest of the first slab, the best fit");
        assert_eq!(a.best_fit(50), Some(2000));
        a.free(1100, 200);
        a.free(1000, 100);
        assert_eq!(a.by_addr.get(&1000), Some(&300), "merged with the block after it");
        a.free(1300, 700);
        assert_eq!(a.by_addr.get(&1000), Some(&1000), "and before");
        a.free(2000, 50);
        assert_eq!(a.by_addr.len(), 2, "not across the second slab's start");
        assert_eq!(a.by_size.len(), 2);
    }

    /// Threads taking and freeing blocks at once leave the bookkeeping whole: every block
    /// freed, the free blocks of each slab merged back into one.
    #[test]
    fn threads_share_the_arena() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let reserved_before = arena().reserved;
        std::thread::scope(|s| {
            for t in 0..4usize {
                s.spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..200usize {
                        let (p, size) = take(MIN_BYTES + (i * 7 + t) % 13 * 4096).unwrap();
                        held.push((p, size));
                        if i % 3 == 0 {
                            let (p, size) = held.swap_remove(i % held.len());
                            // SAFETY: from `take` with this size, freed once.
                            unsafe { give_back(p, size as *mut c_void) };
                        }
                    }
                    for (p, size) in held {
                        // SAFETY: as above.
                        unsafe { give_back(p, size as *mut c_void) };
                    }
                });
            }
        });
        let a = arena();
        assert_eq!(a.by_addr.len(), a.by_size.len());
        let free: usize = a.by_addr.values().sum();
        assert_eq!(free, a.reserved, "every block back");
        assert!(a.reserved - reserved_before <= 2 * SLAB, "blocks reused, not new slabs per request");
    }

    #[test]
    fn outside_holds_for_its_call_on_its_thread() {
        assert!(here());
        outside(|| {
            assert!(!here());
            outside(|| assert!(!here()));
            assert!(!here(), "restored to the outer call's");
            std::thread::spawn(|| assert!(here())).join().unwrap();
        });
        assert!(here());
    }

    /// Through the process's arena: a freed block is the next one a request of its size gets.
    #[test]
    fn a_freed_block_is_taken_again() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let (p, size) = take(3 << 20).unwrap();
        assert_eq!(size, block_size(3 << 20));
        // SAFETY: from `take` with this size, not used after.
        unsafe { give_back(p, size as *mut c_void) };
        let (q, _) = take(3 << 20).unwrap();
        assert_eq!(q, p);
        // SAFETY: as above.
        unsafe { give_back(q, size as *mut c_void) };
    }
}
