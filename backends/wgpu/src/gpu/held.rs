//! One dispatch held back from the recorder, so that the op after it can
//! take it into its own kernel: a one-token `add_rms_norm` whose normed row
//! goes straight to `route_matmul` becomes part of `moe_route_norm`. Anything
//! else recorded, copied or submitted first records the held dispatch, in
//! its place in op order.

use std::any::Any;

use slotstream_backend::{BackendError, Result};

use super::record::no_kernel;
use super::{Bind, Gpu, Pending};
use crate::params::Params;

/// A dispatch not recorded yet, and what an op that takes it over needs.
pub(super) struct Held {
    entry: &'static str,
    params: Vec<u8>,
    binds: Vec<(u32, wgpu::Buffer, u64, u64)>,
    groups: [u32; 3],
    /// The taker's inputs; it also keeps the held dispatch's tensors (and
    /// so their buffers) alive until the dispatch is recorded.
    payload: Box<dyn Any + Send>,
}

impl Gpu {
    /// Holds a dispatch of `entry` back (recording any held before it): it
    /// is recorded before the next dispatch, copy or submission, unless
    /// [`Gpu::take_held`] takes it first. Its bindings must not be small
    /// inputs (`small_input`), which live for one submission.
    pub(crate) fn hold<P: Params>(
        &self,
        entry: &'static str,
        params: &P,
        binds: &[(u32, Bind<'_>)],
        groups: [u32; 3],
        payload: Box<dyn Any + Send>,
    ) -> Result<()> {
        self.kernel::<P>(entry)?.ok_or_else(|| no_kernel(entry))?;
        let mut p = self.pending()?;
        self.release_held(&mut p)?;
        let binds = binds.iter().map(|(i, b)| (*i, b.buffer.clone(), b.offset, b.size)).collect();
        p.held = Some(Held { entry, params: bytemuck::bytes_of(params).to_vec(), binds, groups, payload });
        Ok(())
    }

    /// The held dispatch's payload, if it is a `T` that `accept` takes: the
    /// dispatch is then dropped, and the caller records what replaces it.
    pub(crate) fn take_held<T: Any>(&self, accept: impl FnOnce(&T) -> bool) -> Result<Option<T>> {
        let mut p = self.pending()?;
        if !p.held.as_ref().and_then(|h| h.payload.downcast_ref::<T>()).is_some_and(accept) {
            return Ok(None);
        }
        Ok(p.held.take().and_then(|h| h.payload.downcast::<T>().ok()).map(|t| *t))
    }

    /// Records the held dispatch, if any, where it was asked for.
    pub(super) fn release_held(&self, p: &mut Pending) -> Result<()> {
        let Some(h) = p.held.take() else {
            return Ok(());
        };
        let kernel = self.kernels.get(h.entry).ok_or_else(|| BackendError::Device(format!("no kernel named '{}'", h.entry)))?;
        let binds: Vec<(u32, Bind<'_>)> = h.binds.iter().map(|(i, buffer, offset, size)| (*i, Bind { buffer, offset: *offset, size: *size })).collect();
        // A periodic submission this makes due comes with the next dispatch.
        self.record_in(p, h.entry, kernel, &h.params, &binds, h.groups)?;
        Ok(())
    }
}
