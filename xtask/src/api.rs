//! `cargo xtask api [--bless]`: the public API of every library crate, one item per line,
//! checked against the baseline committed under `api/` so that every change to a crate's
//! surface shows up as a diff in review.
//!
//! The listing is rendered from rustdoc's JSON output (`--output-format json`, unstable, so it
//! is built with `RUSTC_BOOTSTRAP=1` on the pinned stable toolchain, in `target/api`): each
//! public module, re-export, type with its public fields and variants, function with its
//! signature, constant, trait with its items, and each type's inherent methods and the traits
//! it implements (auto traits included: losing `Send` is an API change; blanket impls left
//! out). Generic bounds are rendered; bodies and docs are not.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// The crates whose public API is a contract: every workspace library an adopter depends on.
pub(crate) const CRATES: &[&str] = &[
    "kvroute-costmodel",
    "kvroute-kernels",
    "kvroute-kvstore",
    "kvroute-transport",
    "kvroute-remote",
    "kvroute-sched",
    "kvroute-helix",
    "kvroute-model",
    "kvroute-decode",
];

/// `cargo xtask api [--bless]`: checks (or with `--bless`, rewrites) `api/<crate>.txt`.
pub(crate) fn run(root: &Path, rest: &[String]) -> Result<()> {
    let bless = match rest {
        [] => false,
        [flag] if flag == "--bless" => true,
        _ => bail!("usage: cargo xtask api [--bless]"),
    };
    let target = root.join("target").join("api");
    let mut args = vec!["doc", "--locked", "--no-deps", "--lib"];
    for c in CRATES {
        args.extend(["-p", c]);
    }
    let target_dir = target.to_string_lossy().into_owned();
    args.extend(["--target-dir", &target_dir]);
    crate::cargo_step(
        "api-json",
        &args,
        &[
            ("RUSTC_BOOTSTRAP", "1"),
            ("RUSTDOCFLAGS", "-Z unstable-options --output-format json"),
        ],
    )?;
    let baseline_dir = root.join("api");
    let mut changed = Vec::new();
    for krate in CRATES {
        let lib = krate.replace('-', "_");
        let json = target.join("doc").join(format!("{lib}.json"));
        let text = std::fs::read_to_string(&json)
            .with_context(|| format!("reading {}", json.display()))?;
        let doc: Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))?;
        let listing = render(&doc).with_context(|| format!("rendering {}", json.display()))?;
        let baseline = baseline_dir.join(format!("{krate}.txt"));
        let old = std::fs::read_to_string(&baseline).unwrap_or_default();
        if old == listing {
            continue;
        }
        if bless {
            std::fs::create_dir_all(&baseline_dir)?;
            std::fs::write(&baseline, &listing)
                .with_context(|| format!("writing {}", baseline.display()))?;
            println!("xtask api: rewrote {}", baseline.display());
        } else {
            changed.push(format!("{krate}:\n{}", diff(&old, &listing)));
        }
    }
    if !changed.is_empty() {
        bail!(
            "the public API differs from its baseline in api/ (review it, then run `cargo xtask \
             api --bless` and commit the change):\n{}",
            changed.join("\n")
        );
    }
    println!("xtask api: {} crates match their baselines", CRATES.len());
    Ok(())
}

/// Lines only in `old` (`-`) and only in `new` (`+`).
fn diff(old: &str, new: &str) -> String {
    let old: BTreeSet<&str> = old.lines().collect();
    let new: BTreeSet<&str> = new.lines().collect();
    let mut out = String::new();
    for line in old.difference(&new) {
        let _ = writeln!(out, "  - {line}");
    }
    for line in new.difference(&old) {
        let _ = writeln!(out, "  + {line}");
    }
    out
}

/// The sorted listing of a crate's rustdoc JSON.
pub(crate) fn render(doc: &Value) -> Result<String> {
    let root = doc["root"].as_u64().context("no root id")?;
    let index = doc["index"].as_object().context("no index")?;
    let krate = item(index, root)?["name"]
        .as_str()
        .context("the root has no name")?
        .to_owned();
    let mut lines = BTreeSet::new();
    let mut walker = Walker {
        index,
        lines: &mut lines,
        seen: BTreeSet::new(),
    };
    walker.module(root, &krate)?;
    let mut out = String::new();
    for line in lines {
        out.push_str(&line);
        out.push('\n');
    }
    Ok(out)
}

/// Traits the compiler implements for its own use; left out of the listing.
const INTERNAL_MARKERS: &[&str] = &["Freeze", "StructuralPartialEq", "UnsafeUnpin"];

fn item(index: &serde_json::Map<String, Value>, id: u64) -> Result<&Value> {
    index
        .get(&id.to_string())
        .with_context(|| format!("item {id} is not in the index"))
}

/// Walks public modules from the crate root, collecting one line per public item.
struct Walker<'a> {
    index: &'a serde_json::Map<String, Value>,
    lines: &'a mut BTreeSet<String>,
    /// Items and modules already listed: one re-exported under several paths is listed in
    /// full under the first, its other paths by their `pub use` lines.
    seen: BTreeSet<u64>,
}

impl Walker<'_> {
    fn module(&mut self, id: u64, path: &str) -> Result<()> {
        if !self.seen.insert(id) {
            return Ok(());
        }
        let module = &item(self.index, id)?["inner"]["module"];
        for child in module["items"].as_array().into_iter().flatten() {
            let Some(child) = child.as_u64() else {
                continue;
            };
            // Items a re-export names from another crate are not in this crate's index.
            let Some(it) = self.index.get(&child.to_string()) else {
                continue;
            };
            if it["visibility"] != "public" {
                continue;
            }
            self.item(it, path)?;
        }
        Ok(())
    }

    fn item(&mut self, it: &Value, parent: &str) -> Result<()> {
        // A re-export's name is its own (`pub use a::B as C` names `C`), kept in its inner.
        let name = it["name"]
            .as_str()
            .or_else(|| it["inner"]["use"]["name"].as_str())
            .unwrap_or("_");
        if let Some(id) = it["id"].as_u64()
            && it["inner"].get("use").is_none()
            && !self.seen.insert(id)
        {
            return Ok(());
        }
        self.item_named(it, parent, name)
    }

    fn item_named(&mut self, it: &Value, parent: &str, name: &str) -> Result<()> {
        let path = format!("{parent}::{name}");
        let Some((kind, inner)) = it["inner"].as_object().and_then(|o| o.iter().next()) else {
            return Ok(());
        };
        match kind.as_str() {
            "module" => {
                self.lines.insert(format!("pub mod {path}"));
                if let Some(id) = it["id"].as_u64() {
                    self.seen.remove(&id);
                    self.module(id, &path)?;
                }
            }
            "use" => {
                let source = inner["source"].as_str().unwrap_or("?");
                let glob = inner["is_glob"].as_bool() == Some(true);
                let line = if glob {
                    format!("pub use {parent}::{{{source}::*}}")
                } else {
                    format!("pub use {path} = {source}")
                };
                self.lines.insert(line);
                // What it re-exports from this crate is listed where a user names it.
                let target = inner["id"]
                    .as_u64()
                    .and_then(|id| self.index.get(&id.to_string()).map(|t| (id, t)));
                if let Some((id, target)) = target {
                    if glob {
                        self.module(id, parent)?;
                    } else if self.seen.insert(id) {
                        self.item_named(target, parent, name)?;
                    }
                }
            }
            "function" => {
                self.lines.insert(format!("pub {}", function(&path, inner)));
            }
            "constant" => {
                let ty = ty(&inner["type"]);
                self.lines.insert(format!("pub const {path}: {ty}"));
            }
            "static" => {
                let ty = ty(&inner["type"]);
                let m = if inner["is_mutable"].as_bool() == Some(true) {
                    "mut "
                } else {
                    ""
                };
                self.lines.insert(format!("pub static {m}{path}: {ty}"));
            }
            "type_alias" => {
                let g = generics(&inner["generics"]);
                let ty = ty(&inner["type"]);
                self.lines.insert(format!("pub type {path}{g} = {ty}"));
            }
            "macro" => {
                self.lines.insert(format!("macro {path}!"));
            }
            "struct" | "enum" | "union" => self.data_type(kind, inner, &path)?,
            "trait" => self.trait_(inner, &path)?,
            other => {
                self.lines.insert(format!("pub {other} {path}"));
            }
        }
        Ok(())
    }

    fn data_type(&mut self, kind: &str, inner: &Value, path: &str) -> Result<()> {
        let g = generics(&inner["generics"]);
        self.lines.insert(format!("pub {kind} {path}{g}"));
        let field_ids: Vec<u64> = match kind {
            "struct" => match &inner["kind"] {
                Value::Object(k) if k.contains_key("plain") => ids(&k["plain"]["fields"]),
                Value::Object(k) if k.contains_key("tuple") => k["tuple"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_u64)
                    .collect(),
                _ => Vec::new(),
            },
            "union" => ids(&inner["fields"]),
            _ => Vec::new(),
        };
        for id in field_ids {
            let field = item(self.index, id)?;
            if field["visibility"] == "public" {
                let name = field["name"].as_str().unwrap_or("_");
                let ty = ty(&field["inner"]["struct_field"]);
                self.lines.insert(format!("pub {path}.{name}: {ty}"));
            }
        }
        for id in ids(&inner["variants"]) {
            let variant = item(self.index, id)?;
            let name = variant["name"].as_str().unwrap_or("_");
            let shape = self.variant_shape(&variant["inner"]["variant"]["kind"])?;
            self.lines.insert(format!("pub {path}::{name}{shape}"));
        }
        for id in ids(&inner["impls"]) {
            self.impl_(item(self.index, id)?, path)?;
        }
        Ok(())
    }

    fn variant_shape(&self, kind: &Value) -> Result<String> {
        let fields = |list: &Value| -> Result<Vec<String>> {
            list.as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_u64)
                .map(|id| {
                    let f = item(self.index, id)?;
                    let ty = ty(&f["inner"]["struct_field"]);
                    Ok(match f["name"].as_str() {
                        Some(n) if !n.chars().all(|c| c.is_ascii_digit()) => format!("{n}: {ty}"),
                        _ => ty,
                    })
                })
                .collect()
        };
        Ok(match kind {
            Value::Object(k) if k.contains_key("tuple") => {
                format!("({})", fields(&k["tuple"])?.join(", "))
            }
            Value::Object(k) if k.contains_key("struct") => {
                format!(" {{ {} }}", fields(&k["struct"]["fields"])?.join(", "))
            }
            _ => String::new(),
        })
    }

    fn impl_(&mut self, imp: &Value, path: &str) -> Result<()> {
        let inner = &imp["inner"]["impl"];
        if !inner["blanket_impl"].is_null() {
            return Ok(());
        }
        if let Some(trait_) = inner["trait"].as_object() {
            let t = path_of(&Value::Object(trait_.clone()));
            // Marker traits the compiler implements for its own use, whose presence changes
            // with the toolchain rather than the code.
            if INTERNAL_MARKERS.contains(&t.as_str()) {
                return Ok(());
            }
            let neg = if inner["is_negative"].as_bool() == Some(true) {
                "!"
            } else {
                ""
            };
            let g = generics(&inner["generics"]);
            let w = where_clause(&inner["generics"]);
            let for_ = match ty(&inner["for"]) {
                // The type itself, by its full path; otherwise (`&T`, `Box<T>`) as written.
                t if t.split('<').next() == path.rsplit("::").next() => {
                    t.replacen(path.rsplit("::").next().unwrap_or(""), path, 1)
                }
                t => t,
            };
            self.lines.insert(format!("impl{g} {neg}{t} for {for_}{w}"));
            return Ok(());
        }
        for id in ids(&inner["items"]) {
            let it = item(self.index, id)?;
            if it["visibility"] != "public" {
                continue;
            }
            let name = it["name"].as_str().unwrap_or("_");
            let Some((kind, body)) = it["inner"].as_object().and_then(|o| o.iter().next()) else {
                continue;
            };
            let line = match kind.as_str() {
                "function" => format!("pub {}", function(&format!("{path}::{name}"), body)),
                "assoc_const" => format!("pub const {path}::{name}: {}", ty(&body["type"])),
                other => format!("pub {other} {path}::{name}"),
            };
            self.lines.insert(line);
        }
        Ok(())
    }

    fn trait_(&mut self, inner: &Value, path: &str) -> Result<()> {
        let g = generics(&inner["generics"]);
        let supertraits = bounds(&inner["bounds"]);
        let supertraits = if supertraits.is_empty() {
            String::new()
        } else {
            format!(": {supertraits}")
        };
        let unsafe_ = if inner["is_unsafe"].as_bool() == Some(true) {
            "unsafe "
        } else {
            ""
        };
        self.lines
            .insert(format!("pub {unsafe_}trait {path}{g}{supertraits}"));
        for id in ids(&inner["items"]) {
            let it = item(self.index, id)?;
            let name = it["name"].as_str().unwrap_or("_");
            let Some((kind, body)) = it["inner"].as_object().and_then(|o| o.iter().next()) else {
                continue;
            };
            let line = match kind.as_str() {
                "function" => function(&format!("{path}::{name}"), body),
                "assoc_type" => {
                    let b = bounds(&body["bounds"]);
                    format!("type {path}::{name}: {b}")
                }
                "assoc_const" => format!("const {path}::{name}: {}", ty(&body["type"])),
                other => format!("{other} {path}::{name}"),
            };
            self.lines.insert(line);
        }
        for id in ids(&inner["implementations"]) {
            let imp = item(self.index, id)?;
            if imp["inner"]["impl"]["blanket_impl"].is_null() {
                let for_ = ty(&imp["inner"]["impl"]["for"]);
                self.lines.insert(format!("impl {path} for {for_}"));
            }
        }
        Ok(())
    }
}

fn ids(list: &Value) -> Vec<u64> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_u64)
        .collect()
}

/// `fn path<G>(inputs) -> output where ...`, with its qualifiers.
fn function(path: &str, f: &Value) -> String {
    let header = &f["header"];
    let mut q = String::new();
    for (flag, word) in [
        ("is_const", "const "),
        ("is_async", "async "),
        ("is_unsafe", "unsafe "),
    ] {
        if header[flag].as_bool() == Some(true) {
            q.push_str(word);
        }
    }
    match &header["abi"] {
        Value::String(s) if s == "Rust" => {}
        Value::Null => {}
        abi => {
            let _ = write!(q, "extern {} ", compact(abi));
        }
    }
    let sig = &f["sig"];
    let inputs: Vec<String> = sig["inputs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|pair| {
            let name = pair[0].as_str().unwrap_or("_");
            let t = ty(&pair[1]);
            match name {
                "self" => match t.as_str() {
                    "Self" => "self".to_owned(),
                    "&Self" => "&self".to_owned(),
                    "&mut Self" => "&mut self".to_owned(),
                    _ => format!("self: {t}"),
                },
                _ => format!("{name}: {t}"),
            }
        })
        .collect();
    let output = if sig["output"].is_null() {
        String::new()
    } else {
        format!(" -> {}", ty(&sig["output"]))
    };
    let g = generics(&f["generics"]);
    let w = where_clause(&f["generics"]);
    format!("{q}fn {path}{g}({}){output}{w}", inputs.join(", "))
}

/// `<'a, T: Bound, const N: usize>`, synthetic (`impl Trait` argument) parameters left out.
fn generics(g: &Value) -> String {
    let params: Vec<String> = g["params"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let name = p["name"].as_str().unwrap_or("_");
            let kind = &p["kind"];
            if let Some(t) = kind.get("type") {
                if t["is_synthetic"].as_bool() == Some(true) {
                    return None;
                }
                let b = bounds(&t["bounds"]);
                return Some(if b.is_empty() {
                    name.to_owned()
                } else {
                    format!("{name}: {b}")
                });
            }
            if let Some(c) = kind.get("const") {
                return Some(format!("const {name}: {}", ty(&c["type"])));
            }
            Some(name.to_owned())
        })
        .collect();
    if params.is_empty() {
        String::new()
    } else {
        format!("<{}>", params.join(", "))
    }
}

fn where_clause(g: &Value) -> String {
    let preds: Vec<String> = g["where_predicates"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            if let Some(b) = p.get("bound_predicate") {
                format!("{}: {}", ty(&b["type"]), bounds(&b["bounds"]))
            } else {
                compact(p)
            }
        })
        .collect();
    if preds.is_empty() {
        String::new()
    } else {
        format!(" where {}", preds.join(", "))
    }
}

fn bounds(list: &Value) -> String {
    list.as_array()
        .into_iter()
        .flatten()
        .map(|b| {
            if let Some(t) = b.get("trait_bound") {
                let maybe = if t["modifier"] == "maybe" { "?" } else { "" };
                format!("{maybe}{}", path_of(&t["trait"]))
            } else if let Some(l) = b.get("outlives") {
                l.as_str().unwrap_or("'_").to_owned()
            } else {
                compact(b)
            }
        })
        .collect::<Vec<_>>()
        .join(" + ")
}

/// A path with its generic arguments: `Result<T, E>`, `Fn(u32) -> bool`.
fn path_of(p: &Value) -> String {
    let name = p["path"].as_str().unwrap_or("?");
    let args = &p["args"];
    if let Some(a) = args.get("angle_bracketed") {
        let mut parts: Vec<String> = a["args"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|arg| {
                if let Some(t) = arg.get("type") {
                    ty(t)
                } else if let Some(l) = arg.get("lifetime") {
                    l.as_str().unwrap_or("'_").to_owned()
                } else if let Some(c) = arg.get("const") {
                    c["expr"].as_str().unwrap_or("_").to_owned()
                } else {
                    "_".to_owned()
                }
            })
            .collect();
        for c in a["constraints"].as_array().into_iter().flatten() {
            let n = c["name"].as_str().unwrap_or("_");
            if let Some(eq) = c["binding"].get("equality") {
                let t = eq.get("type").map_or_else(|| compact(eq), ty);
                parts.push(format!("{n} = {t}"));
            } else {
                parts.push(format!("{n}: {}", bounds(&c["binding"]["constraint"])));
            }
        }
        if parts.is_empty() {
            name.to_owned()
        } else {
            format!("{name}<{}>", parts.join(", "))
        }
    } else if let Some(a) = args.get("parenthesized") {
        let inputs: Vec<String> = a["inputs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(ty)
            .collect();
        let out = if a["output"].is_null() {
            String::new()
        } else {
            format!(" -> {}", ty(&a["output"]))
        };
        format!("{name}({}){out}", inputs.join(", "))
    } else {
        name.to_owned()
    }
}

/// A type as Rust writes it; shapes this renderer does not know fall back to compact JSON,
/// which is as stable as rustdoc's output.
fn ty(t: &Value) -> String {
    let Some((kind, v)) = t.as_object().and_then(|o| o.iter().next()) else {
        return compact(t);
    };
    match kind.as_str() {
        "resolved_path" => path_of(v),
        "generic" | "primitive" => v.as_str().unwrap_or("?").to_owned(),
        "borrowed_ref" => {
            let l = v["lifetime"]
                .as_str()
                .map(|l| format!("{l} "))
                .unwrap_or_default();
            let m = if v["is_mutable"].as_bool() == Some(true) {
                "mut "
            } else {
                ""
            };
            format!("&{l}{m}{}", ty(&v["type"]))
        }
        "raw_pointer" => {
            let m = if v["is_mutable"].as_bool() == Some(true) {
                "mut"
            } else {
                "const"
            };
            format!("*{m} {}", ty(&v["type"]))
        }
        "slice" => format!("[{}]", ty(v)),
        "array" => format!("[{}; {}]", ty(&v["type"]), v["len"].as_str().unwrap_or("_")),
        "tuple" => {
            let parts: Vec<String> = v.as_array().into_iter().flatten().map(ty).collect();
            if parts.len() == 1 {
                format!("({},)", parts[0])
            } else {
                format!("({})", parts.join(", "))
            }
        }
        "impl_trait" => format!("impl {}", bounds(v)),
        "dyn_trait" => {
            let mut parts: Vec<String> = v["traits"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| path_of(&p["trait"]))
                .collect();
            if let Some(l) = v["lifetime"].as_str() {
                parts.push(l.to_owned());
            }
            format!("dyn {}", parts.join(" + "))
        }
        "qualified_path" => {
            let self_ = ty(&v["self_type"]);
            let name = v["name"].as_str().unwrap_or("_");
            if v["trait"].is_null() {
                format!("{self_}::{name}")
            } else {
                format!("<{self_} as {}>::{name}", path_of(&v["trait"]))
            }
        }
        "function_pointer" => {
            let f = function("", v);
            f.replacen("fn (", "fn(", 1)
        }
        "infer" => "_".to_owned(),
        _ => compact(t),
    }
}

fn compact(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A crate `k` in rustdoc's JSON shape: `pub mod m { pub struct S { pub a: u32, b: u8 }
    /// impl S { pub fn get(&self) -> Option<&u32> } }`, `mod hidden { pub fn f<T: Clone>(x: T)
    /// }` re-exported as `pub use hidden::f as g`, and a private function.
    fn sample() -> Value {
        serde_json::json!({
            "root": 0,
            "index": {
                "0": {"id": 0, "name": "k", "visibility": "public",
                      "inner": {"module": {"items": [1, 6, 8, 9]}}},
                "1": {"id": 1, "name": "m", "visibility": "public",
                      "inner": {"module": {"items": [2]}}},
                "2": {"id": 2, "name": "S", "visibility": "public",
                      "inner": {"struct": {"generics": {"params": [], "where_predicates": []},
                                "kind": {"plain": {"fields": [3, 4]}}, "impls": [5, 10, 11]}}},
                "3": {"id": 3, "name": "a", "visibility": "public",
                      "inner": {"struct_field": {"primitive": "u32"}}},
                "4": {"id": 4, "name": "b", "visibility": "default",
                      "inner": {"struct_field": {"primitive": "u8"}}},
                "5": {"id": 5, "name": null, "visibility": "default",
                      "inner": {"impl": {"trait": null, "blanket_impl": null, "items": [7],
                                "for": {"resolved_path": {"path": "S", "args": null}},
                                "generics": {"params": [], "where_predicates": []}}}},
                "7": {"id": 7, "name": "get", "visibility": "public",
                      "inner": {"function": {
                          "sig": {"inputs": [["self", {"borrowed_ref": {"lifetime": null,
                                    "is_mutable": false, "type": {"generic": "Self"}}}]],
                                  "output": {"resolved_path": {"path": "Option", "args":
                                    {"angle_bracketed": {"args": [{"type": {"borrowed_ref":
                                      {"lifetime": null, "is_mutable": false,
                                       "type": {"primitive": "u32"}}}}], "constraints": []}}}}},
                          "generics": {"params": [], "where_predicates": []},
                          "header": {"is_const": false, "is_unsafe": false, "is_async": false,
                                     "abi": "Rust"}}}},
                "10": {"id": 10, "name": null, "visibility": "default",
                       "inner": {"impl": {"trait": {"path": "Send", "args": null},
                                 "blanket_impl": null, "is_negative": false, "items": [],
                                 "for": {"resolved_path": {"path": "S", "args": null}},
                                 "generics": {"params": [], "where_predicates": []}}}},
                "11": {"id": 11, "name": null, "visibility": "default",
                       "inner": {"impl": {"trait": {"path": "From", "args": null},
                                 "blanket_impl": {"generic": "T"}, "items": [],
                                 "for": {"generic": "T"},
                                 "generics": {"params": [], "where_predicates": []}}}},
                "6": {"id": 6, "name": null, "visibility": "public",
                      "inner": {"use": {"source": "hidden::f", "name": "g", "id": 12,
                                "is_glob": false}}},
                "12": {"id": 12, "name": "f", "visibility": "public",
                       "inner": {"function": {
                           "sig": {"inputs": [["x", {"generic": "T"}]], "output": null},
                           "generics": {"params": [{"name": "T", "kind": {"type": {
                               "bounds": [{"trait_bound": {"trait": {"path": "Clone",
                                 "args": null}, "modifier": "none"}}],
                               "default": null, "is_synthetic": false}}}],
                               "where_predicates": []},
                           "header": {"is_const": false, "is_unsafe": false, "is_async": false,
                                      "abi": "Rust"}}}},
                "8": {"id": 8, "name": "private", "visibility": "default",
                      "inner": {"function": {}}},
                "9": {"id": 9, "name": "gone", "visibility": "public",
                      "inner": {"constant": {"type": {"primitive": "usize"}}}}
            }
        })
    }

    #[test]
    fn the_listing_has_each_public_item_by_the_path_a_user_writes() {
        let listing = render(&sample()).unwrap();
        assert_eq!(
            listing.lines().collect::<Vec<_>>(),
            [
                "impl Send for k::m::S",
                "pub const k::gone: usize",
                "pub fn k::g<T: Clone>(x: T)",
                "pub fn k::m::S::get(&self) -> Option<&u32>",
                "pub k::m::S.a: u32",
                "pub mod k::m",
                "pub struct k::m::S",
                "pub use k::g = hidden::f",
            ]
        );
    }

    #[test]
    fn a_changed_line_shows_as_removed_and_added() {
        let d = diff("a\nb\n", "a\nc\n");
        assert_eq!(d, "  - b\n  + c\n");
    }
}
