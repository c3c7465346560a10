//! The envd JSON types (proto3 canonical JSON of `process.Process` and `filesystem.Filesystem`,
//! docs/specs/e2b-compat.md §6.2–§6.3) and Connect framing helpers. Request and event types live here;
//! `rpc.rs`, `files.rs` and `http.rs` build the small response objects around them.

use std::collections::HashMap;

use base64::Engine;
use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// envd version this agent implements (docs/specs/e2b-compat.md §6.7): the contract's.
pub use agentenv_envd::ENVD_VERSION;

/// Connect error codes (docs/specs/e2b-compat.md §6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// `canceled` (499).
    Canceled,
    /// `unknown` (500).
    Unknown,
    /// `invalid_argument` (400).
    InvalidArgument,
    /// `deadline_exceeded` (504).
    DeadlineExceeded,
    /// `not_found` (404).
    NotFound,
    /// `already_exists` (409).
    AlreadyExists,
    /// `permission_denied` (403).
    PermissionDenied,
    /// `resource_exhausted` (429).
    ResourceExhausted,
    /// `failed_precondition` (400).
    FailedPrecondition,
    /// `unimplemented` (501).
    Unimplemented,
    /// `internal` (500).
    Internal,
    /// `unavailable` (503).
    Unavailable,
    /// `unauthenticated` (401).
    Unauthenticated,
}

impl Code {
    /// Lowercase Connect name.
    pub fn name(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// HTTP status of a unary error with this code.
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal => 500,
            Code::InvalidArgument | Code::FailedPrecondition => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        }
    }
}

/// A Connect error: code + message.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {message}", code.name())]
pub struct RpcError {
    /// Connect code.
    pub code: Code,
    /// Human-readable text.
    pub message: String,
}

impl RpcError {
    /// Builds an error.
    pub fn new(code: Code, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }

    /// `{"code": "...", "message": "..."}`.
    pub fn to_json(&self) -> Value {
        json!({"code": self.code.name(), "message": self.message})
    }

    /// Maps an I/O error on `path` to the closest Connect code.
    pub fn from_io(e: &std::io::Error, what: &str) -> RpcError {
        use std::io::ErrorKind as K;
        let code = match e.kind() {
            K::NotFound => Code::NotFound,
            K::AlreadyExists => Code::AlreadyExists,
            K::PermissionDenied => Code::PermissionDenied,
            K::InvalidInput | K::NotADirectory | K::IsADirectory | K::DirectoryNotEmpty => {
                Code::InvalidArgument
            }
            K::StorageFull => Code::ResourceExhausted,
            _ => Code::Internal,
        };
        RpcError::new(code, format!("{what}: {e}"))
    }
}

/// Connect envelope flag of the end-of-stream message.
pub const FLAG_END_STREAM: u8 = 0x02;

/// Encodes one Connect envelope.
pub fn envelope(flags: u8, msg: &Value) -> bytes::Bytes {
    let body = serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec());
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(flags);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out.into()
}

/// The end-of-stream envelope: `{}` or `{"error": {...}}`.
pub fn end_stream(err: Option<&RpcError>) -> bytes::Bytes {
    match err {
        None => envelope(FLAG_END_STREAM, &json!({})),
        Some(e) => envelope(FLAG_END_STREAM, &json!({"error": e.to_json()})),
    }
}

/// Splits complete envelopes off the front of `buf`: `(flags, json bytes)`.
/// Returns `Ok(None)` when more bytes are needed; rejects messages over `max`.
pub fn take_envelope(buf: &mut Vec<u8>, max: usize) -> Result<Option<(u8, Vec<u8>)>, RpcError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > max {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("message of {len} bytes over {max}"),
        ));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    let flags = buf[0];
    if flags & 0x01 != 0 {
        return Err(RpcError::new(
            Code::Unimplemented,
            "compressed messages are not supported",
        ));
    }
    let msg = buf[5..5 + len].to_vec();
    buf.drain(..5 + len);
    Ok(Some((flags, msg)))
}

/// Parses a request message, mapping JSON errors to `invalid_argument`.
pub fn parse<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, RpcError> {
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        bytes
    };
    serde_json::from_slice(bytes)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("bad request JSON: {e}")))
}

fn de_u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    match Value::deserialize(d)? {
        Value::Number(n) => n
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| de::Error::custom("not a uint32")),
        Value::String(s) => s.parse().map_err(de::Error::custom),
        Value::Null => Ok(0),
        _ => Err(de::Error::custom("expected a uint32")),
    }
}

fn de_opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    de_u32(d).map(Some)
}

/// Decodes proto3 JSON `bytes`: standard or URL-safe base64, padded or not.
pub fn decode_bytes(s: &str) -> Result<Vec<u8>, RpcError> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let t = s.trim();
    for engine in [&STANDARD, &URL_SAFE, &STANDARD_NO_PAD, &URL_SAFE_NO_PAD] {
        if let Ok(v) = engine.decode(t) {
            return Ok(v);
        }
    }
    Err(RpcError::new(
        Code::InvalidArgument,
        "invalid base64 in bytes field",
    ))
}

/// Encodes `bytes` as standard padded base64.
pub fn encode_bytes(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

// ---------------------------------------------------------------- process.Process

/// `process.ProcessConfig`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct ProcessConfig {
    /// Executable.
    pub cmd: String,
    /// Arguments.
    pub args: Vec<String>,
    /// Extra environment.
    pub envs: HashMap<String, String>,
    /// Working directory; absent = the user's home.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// `process.ProcessSelector` (oneof pid | tag).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ProcessSelector {
    /// Select by pid.
    #[serde(deserialize_with = "de_opt_u32")]
    pub pid: Option<u32>,
    /// Select by tag.
    pub tag: Option<String>,
}

/// `process.PTY.Size`.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default)]
pub struct PtySize {
    /// Columns.
    #[serde(deserialize_with = "de_u32")]
    pub cols: u32,
    /// Rows.
    #[serde(deserialize_with = "de_u32")]
    pub rows: u32,
}

/// `process.PTY`.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default)]
pub struct Pty {
    /// Terminal size.
    pub size: PtySize,
}

/// `process.StartRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct StartRequest {
    /// What to run.
    pub process: ProcessConfig,
    /// Run under a PTY of this size.
    pub pty: Option<Pty>,
    /// Optional name usable in selectors.
    pub tag: Option<String>,
    /// Keep a stdin pipe (absent = true).
    pub stdin: Option<bool>,
}

/// Requests that carry only a selector: Connect, CloseStdin.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct SelectorRequest {
    /// Target process.
    pub process: ProcessSelector,
}

/// `process.UpdateRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct UpdateRequest {
    /// Target process.
    pub process: ProcessSelector,
    /// New PTY size.
    pub pty: Option<Pty>,
}

/// `process.ProcessInput` (oneof stdin | pty, base64).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ProcessInput {
    /// Bytes for stdin.
    pub stdin: Option<String>,
    /// Bytes for the PTY.
    pub pty: Option<String>,
}

impl ProcessInput {
    /// The decoded bytes, whichever member is set.
    pub fn bytes(&self) -> Result<Vec<u8>, RpcError> {
        match (&self.stdin, &self.pty) {
            (Some(s), _) | (None, Some(s)) => decode_bytes(s),
            (None, None) => Ok(Vec::new()),
        }
    }
}

/// `process.SendInputRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct SendInputRequest {
    /// Target process.
    pub process: ProcessSelector,
    /// Input bytes.
    pub input: ProcessInput,
}

/// `process.SendSignalRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct SendSignalRequest {
    /// Target process.
    pub process: ProcessSelector,
    /// `SIGNAL_SIGKILL`, `SIGNAL_SIGTERM` or the number.
    pub signal: Value,
}

impl SendSignalRequest {
    /// The signal number (9 or 15).
    pub fn signal_number(&self) -> Result<i32, RpcError> {
        let n = match &self.signal {
            Value::String(s) => match s.as_str() {
                "SIGNAL_SIGKILL" => 9,
                "SIGNAL_SIGTERM" => 15,
                other => other.parse().unwrap_or(0),
            },
            Value::Number(n) => n.as_i64().unwrap_or(0) as i32,
            _ => 0,
        };
        match n {
            9 | 15 => Ok(n),
            _ => Err(RpcError::new(
                Code::InvalidArgument,
                format!("unsupported signal {}", self.signal),
            )),
        }
    }
}

/// `process.StreamInputRequest` (oneof start | data | keepalive).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct StreamInputRequest {
    /// First message: which process.
    pub start: Option<SelectorRequest>,
    /// Input chunk.
    pub data: Option<StreamInputData>,
    /// Keepalive.
    pub keepalive: Option<Value>,
}

/// `process.StreamInputRequest.DataEvent`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct StreamInputData {
    /// Input bytes.
    pub input: ProcessInput,
}

/// `ProcessInfo` for List.
pub fn process_info(config: &ProcessConfig, pid: u32, tag: Option<&str>) -> Value {
    let mut v = json!({"config": config, "pid": pid});
    if let Some(t) = tag {
        v["tag"] = json!(t);
    }
    v
}

/// `{"event":{"start":{"pid":N}}}`.
pub fn start_event(pid: u32) -> Value {
    json!({"event": {"start": {"pid": pid}}})
}

/// Output channel of a data event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// `data.stdout`.
    Stdout,
    /// `data.stderr`.
    Stderr,
    /// `data.pty`.
    Pty,
}

/// `{"event":{"data":{"stdout":"<b64>"}}}`.
pub fn data_event(stream: Stream, bytes: &[u8]) -> Value {
    let key = match stream {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
        Stream::Pty => "pty",
    };
    json!({"event": {"data": {key: encode_bytes(bytes)}}})
}

/// `{"event":{"end":{...}}}` (exitCode omitted when 0, like proto3 JSON).
pub fn end_event(exit_code: i32, exited: bool, status: &str, error: Option<&str>) -> Value {
    let mut end = json!({"exited": exited, "status": status});
    if exit_code != 0 {
        end["exitCode"] = json!(exit_code);
    }
    if let Some(e) = error {
        end["error"] = json!(e);
    }
    json!({"event": {"end": end}})
}

/// `{"event":{"keepalive":{}}}`.
pub fn keepalive_event() -> Value {
    json!({"event": {"keepalive": {}}})
}

// ---------------------------------------------------------------- filesystem.Filesystem

/// Requests with a single `path` (Stat, MakeDir, Remove).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct PathRequest {
    /// Absolute or home-relative path.
    pub path: String,
}

/// `filesystem.ListDirRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ListDirRequest {
    /// Directory.
    pub path: String,
    /// Levels to descend (0 → 1).
    #[serde(deserialize_with = "de_u32")]
    pub depth: u32,
}

/// `filesystem.MoveRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct MoveRequest {
    /// From.
    pub source: String,
    /// To.
    pub destination: String,
}

/// `filesystem.WatchDirRequest` / `CreateWatcherRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct WatchRequest {
    /// Directory to watch.
    pub path: String,
    /// Watch subdirectories too.
    pub recursive: bool,
    /// Attach an `entry` to each event.
    #[serde(rename = "includeEntry", alias = "include_entry")]
    pub include_entry: bool,
    /// Allow a directory on a network filesystem (refused otherwise).
    #[serde(rename = "allowNetworkMounts", alias = "allow_network_mounts")]
    pub allow_network_mounts: bool,
}

/// Requests carrying a watcher id.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct WatcherIdRequest {
    /// The id CreateWatcher returned.
    #[serde(rename = "watcherId", alias = "watcher_id")]
    pub watcher_id: String,
}

/// `filesystem.FileType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    /// Regular file (or anything that is not a directory/symlink).
    File,
    /// Directory.
    Directory,
    /// Symlink (only for dangling links; others describe the target).
    Symlink,
}

impl FileType {
    /// Enum name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            FileType::File => "FILE_TYPE_FILE",
            FileType::Directory => "FILE_TYPE_DIRECTORY",
            FileType::Symlink => "FILE_TYPE_SYMLINK",
        }
    }
}

/// `filesystem.EntryInfo`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    /// Base name.
    pub name: String,
    /// `FILE_TYPE_*`.
    #[serde(rename = "type")]
    pub file_type: &'static str,
    /// Absolute path.
    pub path: String,
    /// Size in bytes (int64 → JSON string).
    pub size: String,
    /// Mode bits (Go `FileMode` style: directory bit set for directories).
    pub mode: u32,
    /// `ls`-style permission string.
    pub permissions: String,
    /// Owner name.
    pub owner: String,
    /// Group name.
    pub group: String,
    /// RFC 3339 UTC.
    pub modified_time: String,
    /// Link target, for symlinks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// True for symlinks.
    pub is_symlink: bool,
    /// User metadata (`user.e2b.*` extended attributes), where it has any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
}

/// `filesystem.EventType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Created.
    Create,
    /// Written.
    Write,
    /// Removed.
    Remove,
    /// Renamed.
    Rename,
    /// Permissions changed.
    Chmod,
}

impl EventType {
    /// Enum name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            EventType::Create => "EVENT_TYPE_CREATE",
            EventType::Write => "EVENT_TYPE_WRITE",
            EventType::Remove => "EVENT_TYPE_REMOVE",
            EventType::Rename => "EVENT_TYPE_RENAME",
            EventType::Chmod => "EVENT_TYPE_CHMOD",
        }
    }
}

/// `filesystem.FilesystemEvent`: `name` is relative to the watched directory.
pub fn fs_event(name: &str, ty: EventType, entry: Option<&EntryInfo>) -> Value {
    let mut v = json!({"name": name, "type": ty.name()});
    if let Some(e) = entry {
        v["entry"] = json!(e);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_camel_and_snake_case() {
        let a: WatchRequest =
            parse(br#"{"path":"/x","includeEntry":true,"allowNetworkMounts":true}"#).unwrap();
        let b: WatchRequest =
            parse(br#"{"path":"/x","include_entry":true,"allow_network_mounts":true}"#).unwrap();
        assert!(
            a.include_entry && a.allow_network_mounts && b.include_entry && b.allow_network_mounts
        );
        let w: WatcherIdRequest = parse(br#"{"watcher_id":"abc"}"#).unwrap();
        assert_eq!(w.watcher_id, "abc");
        let s: SelectorRequest = parse(br#"{"process":{"pid":"42"}}"#).unwrap();
        assert_eq!(s.process.pid, Some(42));
        assert!(parse::<SelectorRequest>(b"").unwrap().process.pid.is_none());
    }

    #[test]
    fn bytes_accept_every_base64_flavour() {
        let data: Vec<u8> = (0..64).map(|_| rand::random()).collect();
        use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
        assert_eq!(decode_bytes(&STANDARD.encode(&data)).unwrap(), data);
        assert_eq!(decode_bytes(&URL_SAFE_NO_PAD.encode(&data)).unwrap(), data);
        assert!(decode_bytes("***").is_err());
    }

    #[test]
    fn signals_by_name_or_number() {
        let r: SendSignalRequest =
            parse(br#"{"process":{"pid":1},"signal":"SIGNAL_SIGTERM"}"#).unwrap();
        assert_eq!(r.signal_number().unwrap(), 15);
        let r: SendSignalRequest = parse(br#"{"process":{"pid":1},"signal":9}"#).unwrap();
        assert_eq!(r.signal_number().unwrap(), 9);
        let r: SendSignalRequest =
            parse(br#"{"process":{"pid":1},"signal":"SIGNAL_UNSPECIFIED"}"#).unwrap();
        assert_eq!(r.signal_number().unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn envelopes_round_trip() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&envelope(0, &json!({"a": 1})));
        buf.extend_from_slice(&end_stream(None));
        assert_eq!(
            take_envelope(&mut buf, 1024).unwrap(),
            Some((0, br#"{"a":1}"#.to_vec()))
        );
        assert_eq!(
            take_envelope(&mut buf, 1024).unwrap(),
            Some((FLAG_END_STREAM, b"{}".to_vec()))
        );
        assert_eq!(take_envelope(&mut buf, 1024).unwrap(), None);
        let mut big = vec![0u8, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            take_envelope(&mut big, 1024).unwrap_err().code,
            Code::ResourceExhausted
        );
    }
}
