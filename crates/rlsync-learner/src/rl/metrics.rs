//! The trainer's per-step learning metrics and their logged names.

/// Means over the minibatches of one training step (NaN where undefined, e.g. no behaviour-version data).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TrainMetrics {
    /// `actor/loss`: clipped policy-gradient loss.
    pub loss: f64,
    /// `actor/approx_kl`: KL(old ‖ new) estimate against the behaviour log-probs during the update.
    pub approx_kl: f64,
    /// `actor/clip_fraction`: share of samples whose ratio left the clip range.
    pub clip_fraction: f64,
    /// `actor/entropy`: policy entropy per sample.
    pub entropy: f64,
    /// `actor/grad_norm`: global gradient norm before clipping.
    pub grad_norm: f64,
    /// `actor/behav_approx_kl`: trainer log-prob (at the behaviour version, before any update) vs the rollout's
    /// recorded log-prob; ~0 when the rollout acted with exactly the trainer's weights.
    pub behav_approx_kl: f64,
    /// `critic/value_loss` (0 without a critic).
    pub value_loss: f64,
    /// Optimizer steps taken.
    pub optimizer_steps: u64,
}

impl TrainMetrics {
    /// Metric names and values as the run logs them.
    pub fn named(&self) -> [(&'static str, f64); 7] {
        [
            ("actor/loss", self.loss),
            ("actor/approx_kl", self.approx_kl),
            ("actor/clip_fraction", self.clip_fraction),
            ("actor/entropy", self.entropy),
            ("actor/grad_norm", self.grad_norm),
            ("actor/behav_approx_kl", self.behav_approx_kl),
            ("critic/value_loss", self.value_loss),
        ]
    }
}
