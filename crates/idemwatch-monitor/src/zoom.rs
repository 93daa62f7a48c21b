//! The chart's zoom: fixed levels from one minute to the dedup table's retention,
//! stopping at both ends.

use std::time::Duration;

/// Chart zoom levels, from one minute up to the retention window.
pub const ZOOM_LEVELS: [Duration; 8] = [
    Duration::from_secs(60),
    Duration::from_secs(5 * 60),
    Duration::from_secs(15 * 60),
    Duration::from_secs(3600),
    Duration::from_secs(6 * 3600),
    Duration::from_secs(24 * 3600),
    Duration::from_secs(3 * 24 * 3600),
    Duration::from_secs(7 * 24 * 3600),
];

/// The chart's time span; zooming stops at both ends instead of wrapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zoom {
    level: usize,
    max_level: usize,
}

impl Zoom {
    /// Start at the level nearest `window` (docs/CONTRACT.md §7 `chart_window`), allowing levels
    /// up to `retention`.
    pub fn new(window: Duration, retention: Duration) -> Zoom {
        let max_level = ZOOM_LEVELS
            .iter()
            .rposition(|l| *l <= retention)
            .unwrap_or(0);
        let level = ZOOM_LEVELS
            .iter()
            .position(|l| *l >= window)
            .unwrap_or(ZOOM_LEVELS.len() - 1)
            .min(max_level);
        Zoom { level, max_level }
    }

    /// The time range the chart shows now.
    pub fn span(&self) -> Duration {
        ZOOM_LEVELS[self.level]
    }

    /// A shorter span; stays at one minute.
    pub fn zoom_in(&mut self) -> Duration {
        self.level = self.level.saturating_sub(1);
        self.span()
    }

    /// A longer span; stays at the retention.
    pub fn zoom_out(&mut self) -> Duration {
        self.level = (self.level + 1).min(self.max_level);
        self.span()
    }
}
