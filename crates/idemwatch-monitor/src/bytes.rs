//! A dead letter's raw bytes as something a terminal or a page can show: escaped
//! text (never a control sequence) and a hex dump. Shared by the dashboard's raw
//! view, the monitor's previews and the report.

/// Bytes as text a terminal can show: printable ASCII as is, valid UTF-8 letters
/// as themselves, `\n`, `\t`, `\\` and everything else as `\xNN`, never a
/// control sequence that would reach the terminal.
pub fn escaped(raw: &[u8]) -> String {
    let mut out = String::with_capacity(raw.len());
    for chunk in raw.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\n' => out.push_str("\\n"),
                '\t' => out.push_str("\\t"),
                '\\' => out.push_str("\\\\"),
                c if c.is_control() => {
                    let mut b = [0u8; 4];
                    for byte in c.encode_utf8(&mut b).bytes() {
                        out.push_str(&format!("\\x{byte:02x}"));
                    }
                }
                c => out.push(c),
            }
        }
        for byte in chunk.invalid() {
            out.push_str(&format!("\\x{byte:02x}"));
        }
    }
    out
}

/// [`escaped`], broken after each newline and every `width` characters.
pub fn escaped_lines(raw: &[u8], width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    for piece in raw.split_inclusive(|b| *b == b'\n') {
        let text: Vec<char> = escaped(piece).chars().collect();
        for chunk in text.chunks(width.max(1)) {
            lines.push(chunk.iter().collect());
        }
    }
    lines
}

/// `offset  16 bytes in hex  |ASCII|`, one line per 16 bytes.
pub fn hex_dump(raw: &[u8]) -> Vec<String> {
    raw.chunks(16)
        .enumerate()
        .map(|(i, chunk)| {
            let hex: Vec<String> = chunk.iter().map(|b| format!("{b:02x}")).collect();
            let ascii: String = chunk
                .iter()
                .map(|b| {
                    if b.is_ascii_graphic() || *b == b' ' {
                        char::from(*b)
                    } else {
                        '.'
                    }
                })
                .collect();
            format!("{:08x}  {:<47}  |{ascii}|", i * 16, hex.join(" "))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_bytes_never_reach_the_terminal_as_control_sequences() {
        let raw = b"{\"seq\":\"oops\"}\n\x1b[2J\xff\xfe \xc3\xa7";
        assert_eq!(escaped(raw), "{\"seq\":\"oops\"}\\n\\x1b[2J\\xff\\xfe ç");
        let hex = hex_dump(raw);
        assert_eq!(hex.len(), 2);
        assert!(hex[0].starts_with("00000000  7b 22 73 65 71"), "{}", hex[0]);
        assert!(hex[0].ends_with("|{\"seq\":\"oops\"}..|"), "{}", hex[0]);
        assert!(
            hex[1].starts_with("00000010  5b 32 4a ff fe 20 c3 a7"),
            "{}",
            hex[1]
        );
        assert!(hex[1].ends_with("|[2J.. ..|"), "{}", hex[1]);
        assert_eq!(escaped_lines(b"ab\ncd", 80), vec!["ab\\n", "cd"]);
    }
}
