//! What a request may constrain its output to, written as the Lark grammar
//! llguidance compiles (JSON schemas embedded with `%json`).

use anyhow::{bail, Result};
use serde_json::{json, Value};

use crate::dialect::{ToolCallForm, ToolSpec};

/// What the output must be.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// Any JSON object (JSON mode).
    JsonObject,
    /// A JSON value that validates against this schema.
    JsonSchema(Value),
    /// Calls of `tools` in the chat dialect `form` (its markup and grammar
    /// are in `crate::dialect`).
    /// `forced`: the output starts with a call; otherwise it is free until the
    /// model opens one, and from there the call must parse. `parallel`: more
    /// calls may follow the first.
    ToolCalls { tools: Vec<ToolSpec>, forced: bool, parallel: bool, form: ToolCallForm },
}

impl ConstraintSpec {
    /// This constraint with its tool calls written in the form the model's
    /// chat template uses (`None`: the template has no tool calls, and the
    /// request is refused before any grammar is built).
    pub fn in_form(&self, template_form: Option<ToolCallForm>) -> ConstraintSpec {
        match (self, template_form) {
            (ConstraintSpec::ToolCalls { tools, forced, parallel, .. }, Some(form)) => {
                ConstraintSpec::ToolCalls { tools: tools.clone(), forced: *forced, parallel: *parallel, form }
            }
            _ => self.clone(),
        }
    }
}

/// How JSON is written: compact separators as Python's `json.dumps` writes
/// them (as chat templates render earlier calls), no free whitespace (a
/// small model could otherwise spend its tokens on blanks). `lenient`: the
/// keywords the engine does not implement are left unenforced instead of
/// refused (tool parameters: agents such as Claude Code send schemas with
/// `propertyNames`, and a call that ignores one is still a call the client
/// checks; a response format is held to all of its schema or refused).
fn json_style(lenient: bool) -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": lenient})
}

/// The schema with the JSON style attached ([`json_style`]'s `lenient`).
fn styled(schema: &Value, lenient: bool) -> Result<Value> {
    let mut schema = match schema {
        Value::Bool(true) => json!({}),
        Value::Object(_) => schema.clone(),
        _ => bail!("a JSON schema must be an object"),
    };
    bounded_integers(&mut schema);
    short_number_bounds(&mut schema)?;
    if let Some(obj) = schema.as_object_mut() {
        obj.insert("x-guidance".into(), json_style(lenient));
    }
    Ok(schema)
}

/// The most JSON text the schemas of one constraint may hold (a `format` or
/// `response_format` schema, or every tool's name and parameters together):
/// compiling a schema costs time and memory in proportion to its size, and
/// hundreds of times its size in memory (measured in the README's limits).
pub const MAX_SCHEMA_BYTES: usize = 256 << 10;

impl ConstraintSpec {
    /// Refuses what this server will not compile: schemas larger than
    /// [`MAX_SCHEMA_BYTES`], and numbers it cannot hold to their bounds.
    pub(super) fn check(&self) -> Result<()> {
        let schemas: Vec<&Value> = match self {
            ConstraintSpec::JsonObject => Vec::new(),
            ConstraintSpec::JsonSchema(schema) => vec![schema],
            ConstraintSpec::ToolCalls { tools, .. } => tools.iter().map(|t| &t.parameters).collect(),
        };
        let names = match self {
            ConstraintSpec::ToolCalls { tools, .. } => tools.iter().map(|t| t.name.len()).sum(),
            _ => 0,
        };
        let mut size = JsonSize { bytes: names, limit: MAX_SCHEMA_BYTES };
        if schemas.iter().any(|schema| serde_json::to_writer(&mut size, schema).is_err()) || size.bytes > size.limit {
            let what = if matches!(self, ConstraintSpec::ToolCalls { .. }) { "the tools' names and parameters" } else { "the schema" };
            bail!("{what} hold more than {MAX_SCHEMA_BYTES} bytes of JSON, the most this server compiles into a grammar; send a smaller schema");
        }
        let mut patterns = 0;
        for schema in &schemas {
            let mut schema = (*schema).clone();
            each_schema(&mut schema, &mut |obj| {
                patterns += obj.get("patternProperties").and_then(Value::as_object).map_or(0, |p| p.len());
            });
        }
        if patterns > MAX_PATTERN_PROPERTIES {
            bail!(
                "the schemas list {patterns} patternProperties; the most this server compiles is {MAX_PATTERN_PROPERTIES} \
                 (their grammar's cost grows with the cube of their number: 300 take seconds, 1,000 minutes)"
            );
        }
        schemas.iter().try_for_each(|schema| ref_cycle(schema))?;
        schemas.into_iter().try_for_each(check_numbers)
    }
}

/// Refuses `$ref`s that lead back to themselves without anything between
/// (`a` is `b`, `b` is `a`): no value satisfies them, and the grammar engine
/// finds that only mid-output where they are nested (a 500 then, not a 400).
/// A reference back to the root from inside an object (a linked list) is an
/// ordinary recursive schema.
fn ref_cycle(root: &Value) -> Result<()> {
    let mut schema = root.clone();
    let mut starts = Vec::new();
    each_schema(&mut schema, &mut |obj| {
        if let Some(Value::String(target)) = obj.get("$ref") {
            starts.push(target.clone());
        }
    });
    // Targets whose chain of references is known to end (each is walked once).
    let mut ends = std::collections::HashSet::new();
    for start in starts {
        let (mut chain, mut on_chain) = (Vec::new(), std::collections::HashSet::new());
        let mut target = start;
        while let Some(pointer) = target.strip_prefix('#') {
            if ends.contains(&target) {
                break;
            }
            if !on_chain.insert(target.clone()) {
                chain.push(target);
                bail!("the $refs {} only name each other: no value satisfies them", chain.join(" -> "));
            }
            chain.push(target.clone());
            let Some(Value::String(next)) = root.pointer(pointer).and_then(|s| s.get("$ref")) else { break };
            target = next.clone();
        }
        ends.extend(chain);
    }
    Ok(())
}

/// The most `patternProperties` entries one request's schemas may hold
/// together: each key must be checked against every pattern (and, with
/// `additionalProperties: false`, against none of them), and compiling that
/// took 0.05 s for 64, 0.18 s for 100, 5.9 s for 300 and 9 minutes for 1,000
/// (release build, see the README's limits).
pub const MAX_PATTERN_PROPERTIES: usize = 64;

/// Counts the bytes of JSON written to it, failing past `limit`.
struct JsonSize {
    bytes: usize,
    limit: usize,
}

impl std::io::Write for JsonSize {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.bytes += bytes.len();
        if self.bytes > self.limit {
            return Err(std::io::Error::other("over the limit"));
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Refuses an integer or number schema (here or nested) whose bounds the
/// output could not be held to: an integer bound the grammar engine does not
/// hold exactly (beyond 2^53, where 64-bit floats skip integers), or bounds
/// that leave no value.
fn check_numbers(schema: &Value) -> Result<()> {
    let mut error = None;
    let mut schema = schema.clone();
    each_schema(&mut schema, &mut |obj| {
        if error.is_some() {
            return;
        }
        let (integer, number) = (has_type(obj, "integer"), has_type(obj, "number"));
        if !integer && !number {
            return;
        }
        let text = |key: &str| obj.get(key).map_or(String::new(), Value::to_string);
        if integer && !number {
            if let Some(key) = ["minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"].into_iter().find(|key| !held_exactly(obj, key)) {
                error = Some(format!(
                    "the integer bound {key} {} is beyond what constrained output can hold exactly (the grammar engine reads \
                     integer bounds as 64-bit floats: exact up to 2^53 = 9007199254740992 in magnitude); use a number, \
                     or a bound within that range",
                    text(key)
                ));
                return;
            }
            if let (Some(lowest), Some(highest)) = whole_bounds(obj) {
                if lowest > highest {
                    error = Some(format!("the integer schema {} admits no integer: its bounds leave none between them", Value::Object(obj.clone())));
                }
            }
            return;
        }
        let (low, high) = (lower_bound(obj), upper_bound(obj));
        if let (Some((low, low_open)), Some((high, high_open))) = (low, high) {
            if low > high || (low == high && (low_open || high_open)) {
                error = Some(format!("the number schema {} admits no number: its bounds leave none between them", Value::Object(obj.clone())));
            }
        }
    });
    match error {
        Some(e) => bail!("{e}"),
        None => Ok(()),
    }
}

/// Whether the grammar engine holds integer output to `obj`'s bound `key`
/// (if it sets one) exactly: llguidance reads the bound as a 64-bit float,
/// steps past an exclusive one by adding 1.0, and makes the result a 64-bit
/// integer (saturating, and negating it later), which is exact only where
/// the float is. The whole number the schema means must be the one it holds.
fn held_exactly(obj: &serde_json::Map<String, Value>, key: &str) -> bool {
    let Some(v) = obj.get(key).filter(|v| v.is_number()) else { return true };
    let lowest = key.ends_with("inimum");
    let draft4 = |flag: &str| obj.get(flag).and_then(Value::as_bool).unwrap_or(false);
    let exclusive = key.starts_with("exclusive") || draft4(if lowest { "exclusiveMinimum" } else { "exclusiveMaximum" });
    let Some(f) = v.as_f64() else { return false };
    // The whole number meant, from the exact JSON integer where it is one.
    let meant: Option<i128> = match (v.as_i64(), v.as_u64()) {
        (Some(i), _) => Some(i as i128),
        (None, Some(u)) => Some(u as i128),
        _ if f.fract() != 0.0 || f.abs() >= 1e30 => None,
        _ => Some(f as i128),
    };
    // (Casts saturate: a float beyond i128 stays far from any i64.)
    let meant = match (meant, lowest, exclusive) {
        (Some(i), true, true) => i.saturating_add(1),
        (Some(i), false, true) => i.saturating_sub(1),
        (Some(i), _, false) => i,
        (None, true, true) => (f.floor() as i128).saturating_add(1),
        (None, true, false) => f.ceil() as i128,
        (None, false, true) => (f.ceil() as i128).saturating_sub(1),
        (None, false, false) => f.floor() as i128,
    };
    let held = match (lowest, exclusive, f.fract() != 0.0) {
        (true, true, false) => f + 1.0,
        (false, true, false) => f - 1.0,
        (true, _, _) => f.ceil(),
        (false, _, _) => f.floor(),
    } as i64;
    held as i128 == meant && held != i64::MIN
}

/// Whether `obj` allows values of JSON type `name` (its `type` is that, or a list with it).
fn has_type(obj: &serde_json::Map<String, Value>, name: &str) -> bool {
    match obj.get("type") {
        Some(Value::String(t)) => t == name,
        Some(Value::Array(ts)) => ts.iter().any(|t| t == name),
        _ => false,
    }
}

/// The lower bound a schema sets and whether it is exclusive (draft 4's
/// boolean `exclusiveMinimum` too; the tighter where both are numbers).
fn lower_bound(obj: &serde_json::Map<String, Value>) -> Option<(f64, bool)> {
    bound(obj, "minimum", "exclusiveMinimum", f64::max)
}

fn upper_bound(obj: &serde_json::Map<String, Value>) -> Option<(f64, bool)> {
    bound(obj, "maximum", "exclusiveMaximum", f64::min)
}

fn bound(obj: &serde_json::Map<String, Value>, inclusive: &str, exclusive: &str, tighter: fn(f64, f64) -> f64) -> Option<(f64, bool)> {
    let flag = obj.get(exclusive).and_then(Value::as_bool).unwrap_or(false);
    let given = obj.get(inclusive).and_then(Value::as_f64).map(|v| (v, flag));
    let open = obj.get(exclusive).and_then(Value::as_f64).map(|v| (v, true));
    match (given, open) {
        (Some(g), Some(o)) if tighter(g.0, o.0) == o.0 && g.0 != o.0 => Some(o),
        (Some(g), Some(o)) if g.0 == o.0 => Some(o),
        (Some(g), _) => Some(g),
        (None, o) => o,
    }
}

/// The lowest and highest whole numbers a schema's bounds allow.
fn whole_bounds(obj: &serde_json::Map<String, Value>) -> (Option<f64>, Option<f64>) {
    let lowest = lower_bound(obj).map(|(v, open)| if open { v.floor() + 1.0 } else { v.ceil() });
    let highest = upper_bound(obj).map(|(v, open)| if open { v.ceil() - 1.0 } else { v.floor() });
    (lowest, highest)
}

/// Number bounds the grammar engine holds output to exactly. llguidance 1.9
/// lets 0 through an exclusive bound of 0, and lets numbers past a bound
/// written with 16 or 17 significant digits (`1.0000000000000001e-7`); both
/// measured by `number_output_stays_within_its_bounds_or_the_schema_is_refused`.
/// So each bound of a `number` becomes an inclusive one of a few significant
/// digits (of the range's width, or of the bound), rounded inwards: the range
/// only narrows (by a thousandth of its width at most), and the output still
/// follows the schema as given. A range too narrow to hold one such number
/// is refused.
fn short_number_bounds(schema: &mut Value) -> Result<()> {
    // Finer steps (bounds like 1e-22) let output past them, measured as above.
    const FINEST_NUMBER_STEP: i32 = -16;
    let mut error = None;
    each_schema(schema, &mut |obj| {
        if error.is_some() || !has_type(obj, "number") {
            return;
        }
        let (low, high) = (lower_bound(obj), upper_bound(obj));
        // The grid's step, 10^exponent.
        let exponent = match (low, high) {
            (None, None) => return,
            (Some((l, false)), Some((h, false))) if l == h => return,
            (Some((l, _)), Some((h, _))) => ((h - l).log10().floor() as i32).saturating_sub(3),
            (Some((b, _)), None) | (None, Some((b, _))) if b != 0.0 => (b.abs().log10().floor() as i32).saturating_sub(5),
            _ => -6,
        };
        if exponent < FINEST_NUMBER_STEP {
            error = Some(format!(
                "the number schema {} sets bounds finer than 1e{FINEST_NUMBER_STEP} apart or from 0, \
                 beyond what constrained output can hold a number to",
                Value::Object(obj.clone())
            ));
            return;
        }
        let on_grid = |k: f64| if exponent < 0 { k / 10f64.powi(-exponent) } else { k * 10f64.powi(exponent) };
        let step = on_grid(1.0);
        let within_low = |x: f64| low.is_none_or(|(l, open)| x > l || (!open && x == l));
        let within_high = |x: f64| high.is_none_or(|(h, open)| x < h || (!open && x == h));
        let new_low = low.map(|(l, _)| {
            let k = (l / step).ceil();
            if within_low(on_grid(k)) { on_grid(k) } else { on_grid(k + 1.0) }
        });
        let new_high = high.map(|(h, _)| {
            let k = (h / step).floor();
            if within_high(on_grid(k)) { on_grid(k) } else { on_grid(k - 1.0) }
        });
        // (Where 64-bit floats cannot tell the grid's points apart, the bounds may still fall outside.)
        let held = new_low.is_none_or(within_low) && new_high.is_none_or(within_high);
        let (low, high) = (new_low, new_high);
        if let (Some(l), Some(h)) = (low, high) {
            if l > h || !held {
                error = Some(format!(
                    "the number schema {} leaves too narrow a range for constrained output to hold a number to",
                    Value::Object(obj.clone())
                ));
                return;
            }
        }
        for key in ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"] {
            obj.remove(key);
        }
        if let Some(l) = low {
            obj.insert("minimum".into(), l.into());
        }
        if let Some(h) = high {
            obj.insert("maximum".into(), h.into());
        }
    });
    match error {
        Some(e) => bail!("{e}"),
        None => Ok(()),
    }
}

/// The largest integer every JSON parser reads exactly (2^53 - 1).
const SAFE_INTEGER: i64 = (1 << 53) - 1;

/// An integer the schema leaves unbounded is held to +-(2^53 - 1), here and
/// in nested schemas: at most 16 digits, where a weak model could otherwise
/// write digits until its tokens run out (llama.cpp's JSON grammars cap
/// them likewise). Bounds a schema sets stay as written.
fn bounded_integers(schema: &mut Value) {
    each_schema(schema, &mut |obj| {
        if !has_type(obj, "integer") {
            return;
        }
        // The whole numbers the schema's own bounds allow at the ends.
        let (lowest, highest) = whole_bounds(obj);
        // A bound added never contradicts the other one the schema sets
        // (an exclusive one included: `exclusiveMinimum` 2^53 - 1 leaves
        // 2^53 and up, so no maximum is added).
        if lowest.is_none() && highest.is_none_or(|h| h >= -SAFE_INTEGER as f64) {
            obj.insert("minimum".into(), (-SAFE_INTEGER).into());
        }
        if highest.is_none() && lowest.is_none_or(|l| l <= SAFE_INTEGER as f64) {
            obj.insert("maximum".into(), SAFE_INTEGER.into());
        }
    });
}

/// Calls `f` on every object of `schema` and of the schemas nested in it
/// (not on data a schema holds: `const`, `enum`, `default`, `examples`).
fn each_schema(schema: &mut Value, f: &mut impl FnMut(&mut serde_json::Map<String, Value>)) {
    match schema {
        Value::Object(obj) => {
            f(obj);
            for (key, child) in obj.iter_mut() {
                if !matches!(key.as_str(), "const" | "enum" | "default" | "examples") {
                    each_schema(child, f);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|item| each_schema(item, f)),
        _ => {}
    }
}

/// An object schema that lists `properties` and says nothing of others gets
/// `additionalProperties: false`, here and in nested objects: a call's
/// arguments carry only the parameters its tool declares, and a response
/// only the keys its schema lists (as llama.cpp's schema grammars read a
/// schema). The output still validates against the schema as given; it just
/// never invents keys (which a small model otherwise does, until its tokens
/// run out).
pub(super) fn declared_only(schema: &mut Value) {
    each_schema(schema, &mut |obj| {
        let open = obj.contains_key("properties")
            && !obj.contains_key("additionalProperties")
            && !obj.contains_key("patternProperties")
            && !obj.contains_key("unevaluatedProperties");
        if open {
            obj.insert("additionalProperties".into(), false.into());
        }
    });
}

/// A rule's body for JSON following `schema` (`lenient`: see [`json_style`]).
pub(super) fn json_rule(schema: &Value, lenient: bool) -> Result<String> {
    Ok(format!("%json {}", styled(schema, lenient)?))
}

/// The rule's body for a JSON value in a tool call, as a dialect's grammar
/// embeds it: only the properties the schema declares ([`declared_only`]),
/// lenient ([`json_style`]).
pub(super) fn tool_json_rule(schema: &Value) -> Result<String> {
    let mut schema = schema.clone();
    declared_only(&mut schema);
    json_rule(&schema, true)
}
