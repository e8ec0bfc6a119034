//! Kernel profiles count every dispatch once, with a time, whether the
//! timestamps are written inside one pass or a pass is opened per dispatch,
//! across the passes a download ends.

mod common;

use slotstream_backend::Backend;
use slotstream_wgpu::{AdapterChoice, WgpuBackend, WgpuOptions};

fn profile_of_adds(inside: bool) -> Option<(bool, u64, f64)> {
    // Opened only where the shared test device is (SLOTSTREAM_SKIP_GPU_TESTS).
    common::gpu()?;
    let b = WgpuBackend::with_options(&AdapterChoice::allow_software(), WgpuOptions { time_inside_passes: inside, ..WgpuOptions::from_env() })
        .expect("opening the device");
    if b.set_profiling(true).is_err() {
        eprintln!("{} has no timestamp queries: nothing to profile", b.name());
        return None;
    }
    let y = b.upload(&[1.0; 64], &[1, 64]).expect("upload");
    let mut x = b.upload(&[0.0; 64], &[1, 64]).expect("upload");
    for run in [5, 7] {
        for _ in 0..run {
            x = b.add(&x, &y).expect("add");
        }
        // A download ends the pass (and the submission) in the middle.
        assert_eq!(b.download(&x).expect("download")[0], if run == 5 { 5.0 } else { 12.0 });
    }
    let prof = b.kernel_profile();
    b.set_profiling(false).expect("profiling off");
    let dispatches = prof.iter().map(|(_, t)| t.dispatches).sum();
    let seconds = prof.iter().map(|(_, t)| t.seconds).sum();
    Some((b.profiles_inside_passes(), dispatches, seconds))
}

#[test]
fn every_dispatch_is_timed_once_inside_one_pass_or_in_its_own() {
    for inside in [true, false] {
        let Some((timed_inside, dispatches, seconds)) = profile_of_adds(inside) else { return };
        assert!(!timed_inside || inside, "timed inside passes although asked not to");
        assert_eq!(dispatches, 12, "inside passes asked: {inside}, done: {timed_inside}");
        assert!(seconds.is_finite() && seconds > 0.0, "{seconds} s for 12 adds (inside passes: {timed_inside})");
    }
}

/// A benchmark may leave a kernel's dispatches out (to time what they cost):
/// an `add` then records nothing until the list is cleared, and a name that
/// is no kernel is refused.
#[test]
fn skipped_kernels_record_nothing_until_cleared() {
    if common::gpu().is_none() {
        return;
    }
    let b = WgpuBackend::new(&AdapterChoice::allow_software()).expect("opening the device");
    let y = b.upload(&[1.0; 64], &[1, 64]).expect("upload");
    let x = b.upload(&[0.0; 64], &[1, 64]).expect("upload");
    let first = b.add(&x, &y).expect("add");
    assert_eq!(b.download(&first).expect("download")[0], 1.0);
    b.skip_kernels(&["add"]).expect("add is a kernel");
    let skipped = b.add(&first, &y).expect("add");
    let left = b.download(&skipped).expect("download");
    b.skip_kernels(&[]).expect("clearing");
    assert!(left[0] != 2.0, "a skipped add wrote its output");
    assert_eq!(b.download(&b.add(&first, &y).expect("add")).expect("download")[0], 2.0);
    assert!(b.skip_kernels(&["no_such_kernel"]).is_err());
}
