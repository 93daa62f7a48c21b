//! A rendered screen as an SVG picture: each run of cells with one style becomes a
//! `<text>` at its row and column, on the terminal's dark background. The README's
//! pictures come from here (`cargo run --example readme_screens`), so they are the
//! real render functions over real demo data, not drawings.

use std::fmt::Write;

use ratatui::buffer::Buffer;
use ratatui::style::{Color, Modifier};

const CELL_W: f64 = 8.4;
const CELL_H: f64 = 17.0;
const BACKGROUND: &str = "#1e1e1e";
const FOREGROUND: &str = "#d4d4d4";

fn hex(c: Color, default: &str) -> String {
    match c {
        Color::Reset => default.to_string(),
        Color::Black => "#000000".into(),
        Color::Red => "#cd3131".into(),
        Color::Green => "#0dbc79".into(),
        Color::Yellow => "#e5e510".into(),
        Color::Blue => "#2472c8".into(),
        Color::Magenta => "#bc3fbc".into(),
        Color::Cyan => "#11a8cd".into(),
        Color::Gray => "#a0a0a0".into(),
        Color::DarkGray => "#6e6e6e".into(),
        Color::LightRed => "#f14c4c".into(),
        Color::LightGreen => "#23d18b".into(),
        Color::LightYellow => "#f5f543".into(),
        Color::LightBlue => "#3b8eea".into(),
        Color::LightMagenta => "#d670d6".into(),
        Color::LightCyan => "#29b8db".into(),
        Color::White => "#e5e5e5".into(),
        Color::Rgb(r, g, b) => format!("#{r:02x}{g:02x}{b:02x}"),
        Color::Indexed(i) => format!("#{i:02x}{i:02x}{i:02x}"),
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The buffer as an SVG document.
pub fn buffer_to_svg(buf: &Buffer) -> String {
    let area = buf.area;
    let (w, h) = (
        f64::from(area.width) * CELL_W,
        f64::from(area.height) * CELL_H,
    );
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" font-size="14"><rect width="100%" height="100%" fill="{BACKGROUND}"/>"#
    );
    for y in 0..area.height {
        let mut x = 0;
        while x < area.width {
            let cell = &buf[(x, y)];
            let style = cell.style();
            let reversed = style.add_modifier.contains(Modifier::REVERSED);
            let (mut fg, mut bg) = (
                hex(style.fg.unwrap_or(Color::Reset), FOREGROUND),
                hex(style.bg.unwrap_or(Color::Reset), BACKGROUND),
            );
            if reversed {
                std::mem::swap(&mut fg, &mut bg);
            }
            // The run of cells with this exact style.
            let start = x;
            let mut text = String::new();
            while x < area.width && buf[(x, y)].style() == style {
                text.push_str(buf[(x, y)].symbol());
                x += 1;
            }
            let (px, py) = (f64::from(start) * CELL_W, f64::from(y) * CELL_H);
            if bg != BACKGROUND {
                let _ = write!(
                    out,
                    r#"<rect x="{px:.1}" y="{py:.1}" width="{:.1}" height="{CELL_H}" fill="{bg}"/>"#,
                    f64::from(x - start) * CELL_W
                );
            }
            if text.trim().is_empty() {
                continue;
            }
            let weight = if style.add_modifier.contains(Modifier::BOLD) {
                r#" font-weight="bold""#
            } else {
                ""
            };
            let _ = write!(
                out,
                r#"<text x="{px:.1}" y="{:.1}" fill="{fg}"{weight} textLength="{:.1}" lengthAdjust="spacingAndGlyphs" xml:space="preserve">{}</text>"#,
                py + CELL_H - 4.0,
                f64::from(x - start) * CELL_W,
                esc(&text)
            );
        }
    }
    out.push_str("</svg>\n");
    out
}
