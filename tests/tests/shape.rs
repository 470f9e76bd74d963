//! The code stays readable in pieces: no hand-written `.rs` file over 800 lines, no function
//! over 150 lines (from its `fn` line to its closing brace).
//! Generated files (the libfabric bindings) and build outputs are left out.
//!
//! Functions are found by a scanner that blanks comments, strings and character literals and
//! then matches braces; it is tested below on the cases that would fool a simpler one.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_tests::tree::{files_with, workspace_root};

const MAX_FILE_LINES: usize = 800;
const MAX_FN_LINES: usize = 150;

/// `src` with every comment, string literal (plain, byte, raw) and character literal replaced
/// by spaces, newlines kept, so that braces and `fn` in them are not counted. Lifetimes stay.
fn blank_literals(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to.min(b.len())] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        let end = if rest.starts_with(b"//") {
            rest.iter()
                .position(|&c| c == b'\n')
                .map_or(b.len(), |n| i + n)
        } else if rest.starts_with(b"/*") {
            let (mut depth, mut j) = (0usize, i);
            while j < b.len() {
                if b[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if b[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            j
        } else if (rest.starts_with(b"r#") || rest.starts_with(b"r\"") || rest.starts_with(b"br"))
            && (i == 0 || !ident(b[i - 1]))
        {
            let start = if rest[0] == b'b' { 2 } else { 1 };
            let hashes = rest[start..].iter().take_while(|&&c| c == b'#').count();
            if rest.get(start + hashes) == Some(&b'"') {
                let mut close = vec![b'"'];
                close.extend(std::iter::repeat_n(b'#', hashes));
                let body = i + start + hashes + 1;
                b[body..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |n| body + n + close.len())
            } else {
                i + 1
            }
        } else if rest[0] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            j + 1
        } else if rest[0] == b'\'' {
            // A character literal is one character or one escape between quotes; anything
            // else is a lifetime or a label.
            if rest.get(1) == Some(&b'\\') {
                rest.iter()
                    .skip(2)
                    .position(|&c| c == b'\'')
                    .map_or(i + 1, |n| i + n + 3)
            } else {
                let width = src[i + 1..].chars().next().map_or(0, char::len_utf8);
                if width > 0 && rest.get(1 + width) == Some(&b'\'') {
                    i + width + 2
                } else {
                    i + 1
                }
            }
        } else {
            i + 1
        };
        if end > i + 1 {
            blank(&mut out, i, end);
        }
        i = end.max(i + 1);
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `(name, first line, line count)` of every function with a body in `src` (nested ones
/// included; lines are 1-based).
fn functions(src: &str) -> Vec<(String, usize, usize)> {
    let text = blank_literals(src);
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let Some(name) = fn_name(line) else { continue };
        let mut depth = 0usize;
        let mut opened = false;
        'body: for (k, l) in lines.iter().enumerate().skip(at) {
            for c in l.chars() {
                match c {
                    ';' if !opened => break 'body,
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' if opened => {
                        depth -= 1;
                        if depth == 0 {
                            out.push((name, at + 1, k - at + 1));
                            break 'body;
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    out
}

/// The name of the function whose signature starts on `line`, if one does.
fn fn_name(line: &str) -> Option<String> {
    let mut words = line.split_whitespace().peekable();
    while let Some(word) = words.next() {
        let is_qualifier = word.starts_with("pub")
            || [
                "const",
                "async",
                "unsafe",
                "default",
                "extern",
                "\"C\"",
                "\"C-unwind\"",
            ]
            .contains(&word);
        if word == "fn" {
            let next = words.next()?;
            let end = next
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(next.len());
            return (end > 0).then(|| next[..end].to_owned());
        }
        if !is_qualifier {
            return None;
        }
    }
    None
}

#[test]
fn the_scanner_skips_braces_in_literals_and_comments_and_keeps_lifetimes() {
    let src = r###"
fn a<'x, 'y>(s: &'x str, _: &'y str) -> char {
    let _ = "}{ fn b() {";
    let _ = r#"}"#;
    let _ = b"{";
    // }
    /* } /* nested } */ } */
    let _ = '{';
    let _ = '\'';
    '}'
}
pub(crate) async fn c() {
    fn d() {}
}
fn declared_only();
"###;
    let found = functions(src);
    assert_eq!(
        found,
        vec![
            ("a".to_owned(), 2, 10),
            ("c".to_owned(), 12, 3),
            ("d".to_owned(), 13, 1)
        ]
    );
}

#[test]
fn no_file_or_function_is_too_long_to_read() {
    let root = workspace_root();
    // Hand-written sources: the libfabric bindings are generated.
    let files: Vec<_> = ["crates", "xtask", "fuzz", "tests"]
        .iter()
        .flat_map(|dir| files_with(&root.join(dir), &["rs"]))
        .filter(|p| !p.ends_with("bindings.rs"))
        .collect();
    assert!(files.len() > 100, "found only {} sources", files.len());
    let mut long = Vec::new();
    for path in &files {
        let src = std::fs::read_to_string(path).unwrap();
        let shown = path.strip_prefix(&root).unwrap_or(path).display();
        let lines = src.lines().count();
        if lines > MAX_FILE_LINES {
            long.push(format!("{shown}: {lines} lines"));
        }
        for (name, at, len) in functions(&src) {
            if len > MAX_FN_LINES {
                long.push(format!("{shown}:{at}: fn {name} is {len} lines"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "over {MAX_FILE_LINES} lines a file or {MAX_FN_LINES} a function (split by concept):\n{}",
        long.join("\n")
    );
}

/// Top-level element counts of the tuple types in `text` (a signature or a field's type): each
/// `(` that starts a type, after `:`, `->`, `<` or `&`; a pattern's `(` (after `(` or `,`) and
/// a parameter list's (after the name or its generics) are not types.
fn tuple_widths(text: &str) -> Vec<usize> {
    let b = text.as_bytes();
    let mut widths = Vec::new();
    for (i, &c) in b.iter().enumerate() {
        if c != b'(' {
            continue;
        }
        let before = text[..i].trim_end();
        if !(before.ends_with(':')
            || before.ends_with("->")
            || before.ends_with('<')
            || before.ends_with('&')
            || before.ends_with("&mut"))
        {
            continue;
        }
        let (mut depth, mut commas, mut empty) = (0usize, 0usize, true);
        for &d in &b[i..] {
            match d {
                b'(' | b'<' | b'[' => depth += 1,
                b')' | b']' => depth -= 1,
                b'>' => depth = depth.saturating_sub(1),
                b',' if depth == 1 => commas += 1,
                _ if depth == 1 && !d.is_ascii_whitespace() => empty = false,
                _ => {}
            }
            if depth == 0 {
                break;
            }
        }
        if !empty {
            widths.push(commas + 1);
        }
    }
    widths
}

/// Functions and fields visible outside their module (`pub`, `pub(crate)`, `pub(super)`) whose
/// types hold a tuple of three or more elements, as `file:line: item`.
fn wide_tuples_crossing_modules(src: &str) -> Vec<(usize, String)> {
    let blanked = blank_literals(src);
    let mut found = Vec::new();
    let lines: Vec<&str> = blanked.lines().collect();
    for (n, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let Some(rest) = t.strip_prefix("pub") else {
            continue;
        };
        let rest = match rest.strip_prefix('(') {
            Some(r) => match r.split_once(')') {
                Some((_, after)) => after,
                None => continue,
            },
            None => rest,
        };
        let rest = rest.trim_start();
        let item = if let Some(f) = rest
            .strip_prefix("fn ")
            .or_else(|| rest.strip_prefix("unsafe fn "))
            .or_else(|| rest.strip_prefix("const fn "))
        {
            // The signature, up to its body or semicolon.
            let mut sig = f.to_owned();
            let mut k = n + 1;
            while !sig.contains('{') && !sig.contains(';') && k < lines.len() {
                sig.push(' ');
                sig.push_str(lines[k].trim());
                k += 1;
            }
            let sig = sig.split(['{', ';']).next().unwrap_or_default().to_owned();
            let name = sig
                .split(['(', '<'])
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned();
            (format!("fn {name}"), sig)
        } else if let Some((name, ty)) = rest.split_once(':') {
            let name = name.trim();
            if name.is_empty() || !name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_') {
                continue;
            }
            (format!("field {name}"), format!(":{ty}"))
        } else {
            continue;
        };
        if tuple_widths(&item.1).iter().any(|&w| w >= 3) {
            found.push((n + 1, item.0));
        }
    }
    found
}

#[test]
fn the_tuple_scanner_finds_wide_tuple_types_and_not_patterns() {
    assert_eq!(tuple_widths("fn f(a: (u32, u16, f32)) -> u8"), [3]);
    assert_eq!(
        tuple_widths("fn f((a, b, c): (u32, u16), x: Option<(A, B<C, D>, E)>)"),
        [2, 3]
    );
    assert_eq!(tuple_widths("fn f() -> Result<(Vec<u8>, u32), E>"), [2]);
    assert_eq!(tuple_widths("fn f(x: &mut (a, b, c))"), [3]);
    assert_eq!(tuple_widths("fn f() -> ()"), Vec::<usize>::new());
    let src = "pub(super) fn a(\n    x: (u8, u8, u8),\n) {}\nfn private(x: (u8, u8, u8)) {}\n\
               pub struct S {\n    pub f: Vec<(u8, u8, u8)>,\n    g: (u8, u8, u8),\n}\n";
    let found: Vec<String> = wide_tuples_crossing_modules(src)
        .into_iter()
        .map(|(n, item)| format!("{n}: {item}"))
        .collect();
    assert_eq!(found, ["1: fn a", "6: field f"]);
}

/// What crosses a module boundary in `kvroute-remote` is named: no function or field visible
/// outside its module takes, returns or holds a tuple of three or more elements.
#[test]
fn no_wide_tuple_crosses_a_module_boundary_in_remote() {
    let root = workspace_root();
    let mut wide = Vec::new();
    for path in files_with(&root.join("crates/remote/src"), &["rs"]) {
        let src = std::fs::read_to_string(&path).unwrap();
        let shown = path
            .strip_prefix(&root)
            .unwrap_or(&path)
            .display()
            .to_string();
        for (line, item) in wide_tuples_crossing_modules(&src) {
            wide.push(format!("{shown}:{line}: {item}"));
        }
    }
    assert!(
        wide.is_empty(),
        "tuples of three or more elements crossing a module boundary (name them with a struct):\n{}",
        wide.join("\n")
    );
}

/// Registered memory reaches `kvroute-remote` only through the transport's safe types
/// (sealed, granted, staging, copies of what peers write); the attribute keeps it so.
#[test]
fn remote_forbids_unsafe_code() {
    let lib = std::fs::read_to_string(workspace_root().join("crates/remote/src/lib.rs")).unwrap();
    assert!(
        lib.lines().any(|l| l.trim() == "#![forbid(unsafe_code)]"),
        "crates/remote/src/lib.rs must forbid unsafe code"
    );
}
