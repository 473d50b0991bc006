//! Episode bookkeeping for a batch of envs: running returns and lengths, and the finished episodes' metrics.

use rlsync::worker::workload::EpisodeMetrics;

/// Running per-env sums plus the totals of finished episodes.
#[derive(Debug, Clone)]
pub struct EpisodeStats {
    running_return: Vec<f64>,
    running_len: Vec<u64>,
    sum_return: f64,
    sum_len: u64,
    successes: u64,
    episodes: u64,
}

impl EpisodeStats {
    pub fn new(num_envs: usize) -> EpisodeStats {
        EpisodeStats {
            running_return: vec![0.0; num_envs],
            running_len: vec![0; num_envs],
            sum_return: 0.0,
            sum_len: 0,
            successes: 0,
            episodes: 0,
        }
    }

    /// Adds one step of env `env`; `done` closes its episode.
    pub fn record(&mut self, env: usize, reward: f32, done: bool, success: bool) {
        let (Some(ret), Some(len)) = (
            self.running_return.get_mut(env),
            self.running_len.get_mut(env),
        ) else {
            return;
        };
        *ret += f64::from(reward);
        *len += 1;
        if done {
            self.sum_return += *ret;
            self.sum_len += *len;
            self.successes += u64::from(success);
            self.episodes += 1;
            *ret = 0.0;
            *len = 0;
        }
    }

    pub fn finished(&self) -> u64 {
        self.episodes
    }

    /// Forgets unfinished episodes (after a forced reset of every env).
    pub(crate) fn discard_running(&mut self) {
        self.running_return.iter_mut().for_each(|r| *r = 0.0);
        self.running_len.iter_mut().for_each(|l| *l = 0);
    }

    /// Reports and clears the finished episodes.
    pub fn take(&mut self) -> EpisodeMetrics {
        let n = self.episodes;
        let m = if n == 0 {
            EpisodeMetrics::default()
        } else {
            EpisodeMetrics {
                ret: self.sum_return / n as f64,
                success_rate: self.successes as f64 / n as f64,
                episode_len: self.sum_len as f64 / n as f64,
                episodes: n,
            }
        };
        self.sum_return = 0.0;
        self.sum_len = 0;
        self.successes = 0;
        self.episodes = 0;
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_episodes_only() {
        let mut s = EpisodeStats::new(2);
        s.record(0, 1.0, false, false);
        s.record(0, 2.0, true, true);
        s.record(1, 5.0, false, false); // still running: not reported
        s.record(7, 5.0, true, true); // unknown env: ignored, not a panic
        let m = s.take();
        assert_eq!(
            m,
            EpisodeMetrics {
                ret: 3.0,
                success_rate: 1.0,
                episode_len: 2.0,
                episodes: 1
            }
        );
        s.record(1, 1.0, true, false);
        assert_eq!(
            s.take(),
            EpisodeMetrics {
                ret: 6.0,
                success_rate: 0.0,
                episode_len: 2.0,
                episodes: 1
            }
        );
    }

    #[test]
    fn merge_weights_by_episodes() {
        let a = EpisodeMetrics {
            ret: 1.0,
            success_rate: 1.0,
            episode_len: 10.0,
            episodes: 3,
        };
        let b = EpisodeMetrics {
            ret: 5.0,
            success_rate: 0.0,
            episode_len: 2.0,
            episodes: 1,
        };
        assert_eq!(
            a.merge(&b),
            EpisodeMetrics {
                ret: 2.0,
                success_rate: 0.75,
                episode_len: 8.0,
                episodes: 4
            }
        );
        assert_eq!(
            EpisodeMetrics::default()
                .merge(&EpisodeMetrics::default())
                .episodes,
            0
        );
    }
}
