//! The chart's zoom: fixed levels from one minute to the dedup table's retention,
//! stopping at both ends — and, until the operator zooms, a span fitted to the data
//! the dashboard has.
//!
//! A dashboard that opens on its 15-minute window with one minute of data draws that
//! minute as a sliver at the right edge: the first deploy's spike, the reason to
//! look, is three columns wide. So while there is no history (no Prometheus server
//! to fill the window from) and less data than the window, the chart shows
//! [`fitted_span`] of the data's age; it grows with the data and hands over to the
//! configured window once that is full. The first `+`/`-` ends the fitting: from
//! then on the operator's level holds.

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

/// A fitted span grows in steps of this much, so its x axis changes at most twice a
/// minute; past the first minute the data fills more than half of a fitted chart.
pub const FIT_STEP: Duration = Duration::from_secs(30);

/// The span that fits `data` (how long there has been data) in a chart whose full
/// span is `window`: `data` rounded up to a [`FIT_STEP`], at least the shortest zoom
/// level, at most `window`.
pub fn fitted_span(window: Duration, data: Duration) -> Duration {
    let step = FIT_STEP.as_secs();
    let rounded = Duration::from_secs(data.as_secs().div_ceil(step).max(1) * step);
    rounded.max(ZOOM_LEVELS[0]).min(window)
}

/// The chart's time span; zooming stops at both ends instead of wrapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zoom {
    level: usize,
    max_level: usize,
    /// Still fitting to the data (no zoom yet, the level's span not yet full).
    fitting: bool,
    /// The fitted span shown now, shorter than the level's.
    fitted: Option<Duration>,
}

impl Zoom {
    /// Start at the level nearest `window` (docs/CONTRACT.md §7 `chart_window`), allowing levels
    /// up to `retention`; fitted to the data until [`Zoom::fit`] says otherwise.
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
        Zoom {
            level,
            max_level,
            fitting: true,
            fitted: None,
        }
    }

    /// Fit the span to `data`, the age of the oldest data the chart can draw; `None`
    /// when a history source fills any window (nothing to fit). Fitting ends for good
    /// once the data fills the level's span, or there is a history, or the operator
    /// zoomed.
    pub fn fit(&mut self, data: Option<Duration>) {
        if !self.fitting {
            return;
        }
        let level = ZOOM_LEVELS[self.level];
        match data.map(|d| fitted_span(level, d)) {
            Some(span) if span < level => self.fitted = Some(span),
            _ => {
                self.fitting = false;
                self.fitted = None;
            }
        }
    }

    /// Whether the span shown now is fitted to the data (not a zoom level).
    pub fn is_fitted(&self) -> bool {
        self.fitted.is_some()
    }

    /// The time range the chart shows now.
    pub fn span(&self) -> Duration {
        self.fitted.unwrap_or(ZOOM_LEVELS[self.level])
    }

    /// The operator takes over: a zoom from a fitted span starts at the levels
    /// around it (in: the longest one below it, out: the shortest one above it).
    fn stop_fitting(&mut self, zooming_in: bool) {
        self.fitting = false;
        if let Some(fitted) = self.fitted.take() {
            self.level = if zooming_in {
                // Below a fitted span lies at most the level under the current one.
                ZOOM_LEVELS
                    .iter()
                    .rposition(|l| *l < fitted)
                    .map_or(0, |l| l + 1)
            } else {
                ZOOM_LEVELS.iter().rposition(|l| *l <= fitted).unwrap_or(0)
            };
        }
    }

    /// A shorter span; stays at one minute.
    pub fn zoom_in(&mut self) -> Duration {
        self.stop_fitting(true);
        self.level = self.level.saturating_sub(1);
        self.span()
    }

    /// A longer span; stays at the retention.
    pub fn zoom_out(&mut self) -> Duration {
        self.stop_fitting(false);
        self.level = (self.level + 1).min(self.max_level);
        self.span()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn fitted_span_rounds_the_data_up_within_a_minute_and_the_window() {
        let window = secs(15 * 60);
        for (data, span) in [
            (0, 60),
            (1, 60),
            (40, 60),
            (60, 60),
            (61, 90),
            (90, 90),
            (91, 120),
            (299, 300),
            (14 * 60 + 31, 15 * 60),
            (15 * 60, 15 * 60),
            (3 * 3600, 15 * 60),
        ] {
            assert_eq!(fitted_span(window, secs(data)), secs(span), "data {data} s");
        }
        assert_eq!(
            fitted_span(secs(60), secs(200)),
            secs(60),
            "never past the window"
        );
    }

    #[test]
    fn the_first_deploy_fills_a_fitted_chart() {
        // The demo's first deploy comes 40 s in: at 45 s the chart spans one minute,
        // and whenever the chart fits its data, the data covers more than half of it.
        let mut z = Zoom::new(secs(15 * 60), secs(7 * 86400));
        z.fit(Some(secs(45)));
        assert_eq!(z.span(), secs(60));
        assert!(z.is_fitted());
        for age in 60..=14 * 60 + 30 {
            z.fit(Some(secs(age)));
            assert!(z.is_fitted(), "{age}");
            assert!(
                secs(age) * 2 > z.span(),
                "data {age} s in a {:?} span",
                z.span()
            );
        }
    }

    #[test]
    fn fitting_ends_when_the_window_is_full_or_there_is_history() {
        let mut z = Zoom::new(secs(15 * 60), secs(7 * 86400));
        z.fit(Some(secs(200)));
        assert_eq!(z.span(), secs(210));
        z.fit(Some(secs(15 * 60)));
        assert!(!z.is_fitted());
        assert_eq!(z.span(), secs(15 * 60));
        // Fitting does not come back (a restarted data source does not shrink it).
        z.fit(Some(secs(10)));
        assert_eq!(z.span(), secs(15 * 60));

        let mut with_history = Zoom::new(secs(15 * 60), secs(7 * 86400));
        with_history.fit(None);
        assert_eq!(with_history.span(), secs(15 * 60));
        with_history.fit(Some(secs(10)));
        assert_eq!(with_history.span(), secs(15 * 60));
    }

    #[test]
    fn zooming_a_fitted_span_goes_to_the_levels_around_it_and_holds() {
        let week = secs(7 * 86400);
        let mut z = Zoom::new(secs(15 * 60), week);
        z.fit(Some(secs(100)));
        assert_eq!(z.span(), secs(120));
        assert_eq!(z.zoom_out(), secs(5 * 60));
        z.fit(Some(secs(110)));
        assert_eq!(z.span(), secs(5 * 60), "the operator's level holds");

        let mut z = Zoom::new(secs(15 * 60), week);
        z.fit(Some(secs(100)));
        assert_eq!(z.zoom_in(), secs(60));
        let mut z = Zoom::new(secs(15 * 60), week);
        z.fit(Some(secs(30)));
        assert_eq!(z.span(), secs(60));
        assert_eq!(z.zoom_in(), secs(60), "stays at one minute");
        let mut z = Zoom::new(secs(15 * 60), week);
        z.fit(Some(secs(30)));
        assert_eq!(z.zoom_out(), secs(5 * 60));
        let mut z = Zoom::new(secs(15 * 60), week);
        z.fit(Some(secs(400)));
        assert_eq!(z.span(), secs(420));
        assert_eq!(z.zoom_in(), secs(5 * 60));
    }
}
