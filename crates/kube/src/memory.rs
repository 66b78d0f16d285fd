//! Resident memory that follows what the process keeps.
//!
//! glibc's allocator keeps freed memory in its arenas instead of returning it to the kernel.
//! A sidecar that listed 2000 jobs with 64 KiB payloads stayed at 131 MiB resident although its
//! cache drops every payload (17 MiB with 100-byte payloads; benchmark row 8), and a controller
//! that saw them arrive one by one grew by half. Freed memory is therefore handed back after
//! every watch (re-)list and every few seconds. Where the allocator is not glibc's (the static
//! musl image) this does nothing.
//!
//! Trimming was not enough: after a list of 2000 jobs with 64 KiB payloads the sidecar still
//! held 36 to 42 MiB against 16 to 18 with 100-byte payloads, because glibc raises its mmap
//! threshold after each large free (up to 32 MiB), so later payloads and list pages came from
//! the heap, where the small cache entries allocated between them pinned its pages.
//! [`configure`] fixes the threshold at [`MMAP_THRESHOLD_BYTES`]: the same benchmark then
//! measured 17 MiB for both sizes, and the controller 20 against 21 MiB (row 8).

use std::time::Duration;

/// Allocations of at least this many bytes (KiB-sized payloads and results, the bodies of
/// list pages) get a mapping of their own, handed back to the kernel when freed, instead of a
/// place in the heap that a small long-lived allocation next to it can pin.
pub const MMAP_THRESHOLD_BYTES: usize = 32 * 1024;

/// Sets the allocator up for [`MMAP_THRESHOLD_BYTES`] (glibc's `M_MMAP_THRESHOLD`, which also
/// stops glibc from raising the threshold by itself after each large free, as it does by
/// default up to 32 MiB); a no-op elsewhere. Call once, early.
pub fn configure() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's parameters for later allocations.
    unsafe {
        libc::mallopt(
            libc::M_MMAP_THRESHOLD,
            i32::try_from(MMAP_THRESHOLD_BYTES).unwrap_or(i32::MAX),
        );
    }
}

/// How often [`trim_periodically`] hands freed memory back.
pub const TRIM_PERIOD: Duration = Duration::from_secs(5);

/// Hands heap memory that is free back to the kernel (glibc's `malloc_trim(0)`); a no-op
/// elsewhere. Costs well under a millisecond for a heap of tens of MiB.
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages to the kernel; it takes the allocator's own
    // locks and touches no memory the program owns.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Runs [`release_freed`] every [`TRIM_PERIOD`], forever (spawn it).
pub async fn trim_periodically() {
    let mut tick = tokio::time::interval(TRIM_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        release_freed();
    }
}
