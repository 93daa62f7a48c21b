//! The six screens and where their titles sit in the header (so a click can find
//! its tab). Its own module: both the actions and the app name tabs.

/// The six screens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

/// Below this width the compact layouts apply (short tab titles, fewer columns,
/// one panel at a time).
pub const COMPACT_WIDTH: u16 = 100;

/// The header's fixed prefix before the tab titles.
pub fn header_prefix(width: u16) -> &'static str {
    if width < COMPACT_WIDTH {
        " idw "
    } else {
        " idemwatch "
    }
}

/// A tab's title in the header: in a compact header only the current tab is named.
pub fn header_title(i: usize, tab: Tab, width: u16, current: Tab) -> String {
    if width < COMPACT_WIDTH && tab != current {
        format!(" {} ", i + 1)
    } else {
        format!(" {} {} ", i + 1, tab.title())
    }
}

/// (first, last) column of each tab title in the header (row 0), so a click can find
/// its tab; the header renders titles at exactly these places.
pub fn tab_spans(width: u16, current: Tab) -> [(u16, u16); 6] {
    let mut spans = [(0u16, 0u16); 6];
    let mut x = header_prefix(width).chars().count() as u16;
    for (i, tab) in Tab::ALL.iter().enumerate() {
        let w = header_title(i, *tab, width, current).chars().count() as u16;
        spans[i] = (x, x + w - 1);
        x += w + 1; // the separator
    }
    spans
}
