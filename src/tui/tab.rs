//! The six screens and where their titles sit in the header (so a click can find
//! its tab). Its own module: both the actions and the app name tabs.

/// The six screens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tab {
    Overview,
    Duplicates,
    Vehicles,
    Drills,
    Tables,
    Inventory,
}

impl Tab {
    pub const ALL: [Tab; 6] = [
        Tab::Overview,
        Tab::Duplicates,
        Tab::Vehicles,
        Tab::Drills,
        Tab::Tables,
        Tab::Inventory,
    ];

    pub fn title(self) -> &'static str {
        match self {
            Tab::Overview => "Overview",
            Tab::Duplicates => "Duplicates",
            Tab::Vehicles => "Vehicles",
            Tab::Drills => "Drills",
            Tab::Tables => "Tables",
            Tab::Inventory => "Inventory",
        }
    }

    pub fn index(self) -> usize {
        Tab::ALL.iter().position(|t| *t == self).unwrap_or(0)
    }

    pub fn offset(self, by: isize) -> Tab {
        let n = Tab::ALL.len() as isize;
        Tab::ALL[((self.index() as isize + by).rem_euclid(n)) as usize]
    }
}

/// The header's fixed prefix before the tab titles.
pub const HEADER_PREFIX: &str = " idemwatch ";

/// (first, last) column of each tab title in the header (row 0), so a click can find
/// its tab; the header renders titles at exactly these places.
pub fn tab_spans() -> [(u16, u16); 6] {
    let mut spans = [(0u16, 0u16); 6];
    let mut x = HEADER_PREFIX.chars().count() as u16;
    for (i, tab) in Tab::ALL.iter().enumerate() {
        let width = format!(" {} {} ", i + 1, tab.title()).chars().count() as u16;
        spans[i] = (x, x + width - 1);
        x += width + 1; // the separator
    }
    spans
}
