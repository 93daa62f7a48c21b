//! The chart's y axis: a linear scale clamped so one spike does not flatten the
//! baselines, or a log one.

use idemwatch_monitor::alerts::DEPLOY_DAY_RATIO;

/// The floor of the log scale, in percent (0.001 %): zero sits there.
pub(super) const LOG_FLOOR_PCT: f64 = 0.001;

/// The y axis: a clamped linear scale, or a log one.
#[derive(Debug, Clone, Copy)]
pub(super) enum Scale {
    Linear { max: f64, clipped: usize, peak: f64 },
    Log { max_decade: f64 },
}

impl Scale {
    /// Percent values in, y coordinates out.
    pub(super) fn y(self, pct: f64) -> f64 {
        match self {
            Scale::Linear { max, .. } => pct.min(max),
            Scale::Log { .. } => pct.max(LOG_FLOOR_PCT).log10(),
        }
    }

    pub(super) fn bounds(self) -> [f64; 2] {
        match self {
            Scale::Linear { max, .. } => [0.0, max],
            Scale::Log { max_decade } => [LOG_FLOOR_PCT.log10(), max_decade],
        }
    }

    pub(super) fn clipped(self, pct: f64) -> bool {
        matches!(self, Scale::Linear { max, .. } if pct > max)
    }

    /// (value in percent, label) ticks of the axis.
    pub(super) fn ticks(self) -> Vec<(f64, String)> {
        match self {
            Scale::Linear { max, .. } => vec![
                (0.0, "0%".into()),
                (max / 2.0, format!("{:.2}%", max / 2.0)),
                (max, format!("{max:.2}%")),
            ],
            Scale::Log { max_decade } => (LOG_FLOOR_PCT.log10() as i32..=max_decade as i32)
                .map(|d| {
                    let v = 10f64.powi(d);
                    (v, format!("{}%", trim_pct(v)))
                })
                .collect(),
        }
    }
}

fn trim_pct(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The clamped linear scale: the 95th percentile ×1.5, never below the deploy-day
/// baseline ×1.25 (so both baselines stay readable).
pub(super) fn linear_scale(values: &mut [f64]) -> Scale {
    let floor = DEPLOY_DAY_RATIO * 100.0 * 1.25;
    if values.is_empty() {
        return Scale::Linear {
            max: floor,
            clipped: 0,
            peak: 0.0,
        };
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let p95 = values[((values.len() - 1) as f64 * 0.95).round() as usize];
    let peak = values[values.len() - 1];
    let max = (p95 * 1.5).max(floor).min(peak.max(floor));
    Scale::Linear {
        max,
        clipped: values.iter().filter(|v| **v > max).count(),
        peak,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_spike_does_not_flatten_the_baselines() {
        // An hour of 0.01 % with one 48 % spike.
        let mut values: Vec<f64> = (0..3600).map(|_| 0.01).collect();
        values.extend([48.0, 30.0, 12.0]);
        let Scale::Linear { max, clipped, peak } = linear_scale(&mut values) else {
            panic!("linear");
        };
        assert!(max < 1.0, "{max}");
        assert!(
            max >= DEPLOY_DAY_RATIO * 100.0,
            "the deploy baseline is on the chart"
        );
        assert_eq!(clipped, 3);
        assert_eq!(peak, 48.0);
    }
}
