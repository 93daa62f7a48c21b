//! One file per screen; each is a pure `render(frame, area, &App, &Theme)`.

pub mod drills;
pub mod duplicates;
pub mod inventory;
pub mod overview;
pub mod tables;
pub mod vehicles;
