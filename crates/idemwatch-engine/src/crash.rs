//! Named crash points that drills arm to reproduce the field report: a consumer that
//! dies between doing its work and acknowledging the message.

use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;

use serde::Serialize;

/// Where in the deliver → handle → commit → ack path a consumer can be made to die.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum CrashPoint {
    /// The side-effect claim is committed, the provider has not been called.
    AfterClaim,
    /// The provider was called, its result is not recorded (the in-doubt window).
    AfterSideEffect,
    /// The handler returned (its transaction committed), nothing counted yet.
    AfterHandle,
    /// Everything committed and counted; the ack is the only step left. The 7-SMS bug.
    AfterCommitBeforeAck,
}

impl CrashPoint {
    pub fn as_str(self) -> &'static str {
        match self {
            CrashPoint::AfterClaim => "after-claim",
            CrashPoint::AfterSideEffect => "after-side-effect",
            CrashPoint::AfterHandle => "after-handle",
            CrashPoint::AfterCommitBeforeAck => "after-commit-before-ack",
        }
    }
}

impl fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CrashPoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            CrashPoint::AfterClaim,
            CrashPoint::AfterSideEffect,
            CrashPoint::AfterHandle,
            CrashPoint::AfterCommitBeforeAck,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| format!("unknown crash point {s:?}"))
    }
}

/// How an armed crash point dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashStyle {
    /// The worker stops where it is and returns [`Crashed`]; nothing after the point
    /// runs (no ack, no record). Used in-process: the "restart" is a new worker.
    Unwind,
    /// `std::process::abort()`: a real process death, no destructors, no flush.
    Abort,
}

/// The worker died at a crash point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("crashed at {0}")]
pub struct Crashed(pub CrashPoint);

/// The crash points armed for one incarnation of a worker.
#[derive(Debug)]
pub struct CrashPlan {
    style: CrashStyle,
    armed: Mutex<Vec<(CrashPoint, u32)>>,
}

impl Default for CrashPlan {
    fn default() -> Self {
        CrashPlan::none()
    }
}

impl CrashPlan {
    /// Nothing armed: production.
    pub fn none() -> Self {
        CrashPlan {
            style: CrashStyle::Unwind,
            armed: Mutex::new(Vec::new()),
        }
    }

    /// Die at `point` the next `times` times it is reached.
    pub fn at(point: CrashPoint, times: u32, style: CrashStyle) -> Self {
        CrashPlan {
            style,
            armed: Mutex::new(vec![(point, times)]),
        }
    }

    /// Arm `point` for the next `times` passes of a running worker (a simulated
    /// deploy kills consumers mid-flight this way).
    pub fn arm(&self, point: CrashPoint, times: u32) {
        let mut armed = self.armed.lock().unwrap_or_else(|e| e.into_inner());
        armed.push((point, times));
    }

    /// Crashes still to come.
    pub fn pending(&self) -> u32 {
        let armed = self.armed.lock().unwrap_or_else(|e| e.into_inner());
        armed.iter().map(|(_, n)| n).sum()
    }

    pub fn style(&self) -> CrashStyle {
        self.style
    }

    /// Pass through `point`, or die there if it is armed.
    pub fn reach(&self, point: CrashPoint) -> Result<(), Crashed> {
        let fire = {
            let mut armed = self.armed.lock().unwrap_or_else(|e| e.into_inner());
            match armed.iter_mut().find(|(p, n)| *p == point && *n > 0) {
                Some((_, n)) => {
                    *n -= 1;
                    true
                }
                None => false,
            }
        };
        if !fire {
            return Ok(());
        }
        match self.style {
            CrashStyle::Unwind => Err(Crashed(point)),
            CrashStyle::Abort => {
                tracing::warn!(%point, "armed crash point reached: aborting the process");
                std::process::abort()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn armed_point_fires_the_given_number_of_times() {
        let plan = CrashPlan::at(CrashPoint::AfterCommitBeforeAck, 2, CrashStyle::Unwind);
        assert!(plan.reach(CrashPoint::AfterClaim).is_ok());
        assert!(plan.reach(CrashPoint::AfterCommitBeforeAck).is_err());
        assert!(plan.reach(CrashPoint::AfterCommitBeforeAck).is_err());
        assert!(plan.reach(CrashPoint::AfterCommitBeforeAck).is_ok());
        assert_eq!(
            "after-side-effect".parse::<CrashPoint>(),
            Ok(CrashPoint::AfterSideEffect)
        );
    }
}
