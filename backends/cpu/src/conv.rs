//! Causal depthwise convolution over time with a carried window (the short
//! convolutions of linear-attention layers).

use slotstream_backend::{DeviceState, Result};

use crate::for_each_piece;

/// The last `(kernel-1)*dilation` inputs of a causal convolution, `[.., channels]`.
pub struct ConvState {
    pub(crate) channels: usize,
    pub(crate) kernel: usize,
    pub(crate) dilation: usize,
    window: Vec<f32>,
}

impl ConvState {
    pub(crate) fn new(channels: usize, kernel: usize, dilation: usize) -> ConvState {
        ConvState { channels, kernel, dilation, window: vec![0.0; (kernel - 1) * dilation * channels] }
    }

    /// Convolves `x: [tokens, channels]` with `w: [channels, kernel]`,
    /// continuing from the window, which then holds the latest inputs.
    pub(crate) fn convolve(&mut self, x: &[f32], wd: &[f32], tokens: usize) -> Vec<f32> {
        let (c, kk, dil) = (self.channels, self.kernel, self.dilation);
        // The window followed by the new inputs: [(kernel-1)*dilation+tokens, channels].
        let mut seq = self.window.clone();
        seq.extend_from_slice(x);
        let mut out = vec![0.0f32; tokens * c];
        let seq_ref = &seq;
        for_each_piece(&mut out, c, tokens * c * kk, |t, o| {
            for ((ch, o), taps) in o.iter_mut().enumerate().zip(wd.chunks_exact(kk)) {
                let mut acc = 0.0;
                for (j, w) in taps.iter().enumerate() {
                    acc += w * seq_ref[(t + j * dil) * c + ch];
                }
                *o = acc;
            }
        });
        self.window = seq[tokens * c..].to_vec();
        out
    }
}

impl DeviceState for ConvState {
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        Ok(Box::new(ConvState { window: self.window.clone(), ..*self }))
    }

    fn bytes(&self) -> usize {
        4 * self.window.len()
    }
}
