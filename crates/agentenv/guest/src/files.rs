//! `/files`: download (GET) and upload (POST, multipart or octet-stream, optional gzip).

use std::io::Write;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures_util::TryStreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use crate::Agent;
use crate::fs;
use crate::http::{Body, channel_body, http_error, json_response, query_params, request_user};
use crate::users::User;

/// Download chunk size.
const CHUNK: usize = 64 * 1024;

/// Why an upload failed, with its HTTP status.
struct UploadError(StatusCode, String);

impl UploadError {
    fn io(e: std::io::Error, path: &Path) -> UploadError {
        UploadError(io_status(&e), format!("writing '{}': {e}", path.display()))
    }
}

/// The HTTP status of a file-system error on a client's path: the client's path is at fault (4xx)
/// unless the guest itself failed.
fn io_status(e: &std::io::Error) -> StatusCode {
    match e.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT) => StatusCode::INSUFFICIENT_STORAGE,
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => StatusCode::FORBIDDEN,
        Some(
            libc::ENOENT
            | libc::ENOTDIR
            | libc::EISDIR
            | libc::EEXIST
            | libc::ENAMETOOLONG
            | libc::EINVAL
            | libc::ELOOP
            | libc::EXDEV
            | libc::ENXIO
            | libc::ENODEV,
        ) => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn resolve_user_and_path(
    agent: &Agent,
    req: &Request<Incoming>,
) -> Result<(User, Option<PathBuf>), Box<Response<Body>>> {
    let q = query_params(req.uri());
    let user = request_user(agent, req.headers(), q.get("username").map(String::as_str))
        .map_err(|e| Box::new(http_error(StatusCode::UNAUTHORIZED, e.message)))?;
    let path = match q.get("path").filter(|p| !p.is_empty()) {
        Some(p) => Some(
            fs::resolve(&user, p)
                .map_err(|e| Box::new(http_error(StatusCode::BAD_REQUEST, e.message)))?,
        ),
        None => None,
    };
    Ok((user, path))
}

/// GET /files?path=…: raw bytes, streamed.
pub async fn download(agent: &Agent, req: Request<Incoming>) -> Response<Body> {
    let (_user, path) = match resolve_user_and_path(agent, &req) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let Some(path) = path else {
        return http_error(StatusCode::BAD_REQUEST, "missing path");
    };
    let meta = match tokio::fs::metadata(&path).await {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return http_error(
                StatusCode::NOT_FOUND,
                format!("path '{}' does not exist", path.display()),
            );
        }
        Err(e) => {
            return http_error(io_status(&e), format!("stat '{}': {e}", path.display()));
        }
    };
    if meta.is_dir() {
        return http_error(
            StatusCode::BAD_REQUEST,
            format!("path '{}' is a directory", path.display()),
        );
    }
    let file = match tokio::fs::File::open(&path).await {
        Ok(f) => f,
        Err(e) => {
            return http_error(io_status(&e), format!("open '{}': {e}", path.display()));
        }
    };
    // Files that report no size (`/proc`, `/sys`) are read to their end and sent chunked; others
    // send exactly the size they had when opened.
    let size = (meta.len() > 0).then_some(meta.len());
    let mut file = file.take(size.unwrap_or(u64::MAX));
    let (tx, body) = channel_body();
    tokio::spawn(async move {
        let mut buf = vec![0u8; CHUNK];
        while let Ok(n) = file.read(&mut buf).await {
            if n == 0 || tx.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                break;
            }
        }
    });
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().replace('"', ""))
        .unwrap_or_default();
    let mut resp = Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/octet-stream");
    if let Some(n) = size {
        resp = resp.header(http::header::CONTENT_LENGTH, n);
    }
    resp.header(
        http::header::CONTENT_DISPOSITION,
        format!("attachment; filename=\"{name}\""),
    )
    .body(body)
    .unwrap_or_else(|_| http_error(StatusCode::INTERNAL_SERVER_ERROR, "building response"))
}

/// POST /files: returns `[{"name","type","path"}]` for every written file.
pub async fn upload(agent: &Agent, req: Request<Incoming>) -> Response<Body> {
    let (user, path) = match resolve_user_and_path(agent, &req) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let limit = agent.config.max_upload_bytes;
    let meta = match crate::meta::from_headers(req.headers()) {
        Ok(m) => m,
        Err(e) => return http_error(StatusCode::BAD_REQUEST, e),
    };
    let ctype = header(&req, http::header::CONTENT_TYPE);
    let gzip = header(&req, http::header::CONTENT_ENCODING).eq_ignore_ascii_case("gzip");
    let result = if ctype.starts_with("multipart/form-data") {
        upload_multipart(&user, path, &ctype, req.into_body(), limit, &meta).await
    } else {
        match path {
            Some(p) => upload_raw(&user, &p, req.into_body(), gzip, limit, &meta)
                .await
                .map(|e| vec![e]),
            None => Err(UploadError(StatusCode::BAD_REQUEST, "missing path".into())),
        }
    };
    match result {
        Ok(entries) if !entries.is_empty() => json_response(StatusCode::OK, &Value::Array(entries)),
        Ok(_) => http_error(StatusCode::BAD_REQUEST, "no file in the request"),
        Err(UploadError(status, msg)) => http_error(status, msg),
    }
}

fn header(req: &Request<Incoming>, name: http::header::HeaderName) -> String {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

async fn upload_multipart(
    user: &User,
    path: Option<PathBuf>,
    ctype: &str,
    body: Incoming,
    limit: u64,
    meta: &Meta,
) -> Result<Vec<Value>, UploadError> {
    let boundary = multer::parse_boundary(ctype)
        .map_err(|e| UploadError(StatusCode::BAD_REQUEST, e.to_string()))?;
    let stream = body.into_data_stream();
    let mut mp = multer::Multipart::new(stream, boundary);
    let mut written = Vec::new();
    let mut n_parts = 0usize;
    while let Some(field) = mp
        .next_field()
        .await
        .map_err(|e| UploadError(StatusCode::BAD_REQUEST, e.to_string()))?
    {
        n_parts += 1;
        // One part with ?path=: path wins. Several parts: each filename is its destination.
        let dest = match (&path, field.file_name()) {
            (Some(p), _) if n_parts == 1 => p.clone(),
            (_, Some(f)) if !f.is_empty() => {
                fs::resolve(user, f).map_err(|e| UploadError(StatusCode::BAD_REQUEST, e.message))?
            }
            _ => {
                return Err(UploadError(
                    StatusCode::BAD_REQUEST,
                    "file part without a destination".into(),
                ));
            }
        };
        let mut sink = crate::blocking(|| Sink::create(user, &dest, limit))?;
        let mut field = field;
        while let Some(chunk) = field
            .chunk()
            .await
            .map_err(|e| UploadError(StatusCode::BAD_REQUEST, e.to_string()))?
        {
            crate::blocking(|| sink.write(&chunk))?;
        }
        written.push(crate::blocking(|| sink.finish(meta))?);
    }
    Ok(written)
}

async fn upload_raw(
    user: &User,
    dest: &Path,
    body: Incoming,
    gzip: bool,
    limit: u64,
    meta: &Meta,
) -> Result<Value, UploadError> {
    let mut stream = body.into_data_stream();
    let mut sink = crate::blocking(|| Sink::create(user, dest, limit))?;
    let mut gz = gzip.then(|| flate2::write::GzDecoder::new(Vec::new()));
    while let Some(chunk) = stream
        .try_next()
        .await
        .map_err(|e| UploadError(StatusCode::BAD_REQUEST, e.to_string()))?
    {
        match gz.as_mut() {
            None => crate::blocking(|| sink.write(&chunk))?,
            Some(d) => {
                d.write_all(&chunk)
                    .map_err(|e| UploadError(StatusCode::BAD_REQUEST, format!("gzip: {e}")))?;
                let out = std::mem::take(d.get_mut());
                crate::blocking(|| sink.write(&out))?;
            }
        }
    }
    if let Some(d) = gz {
        let out = d
            .finish()
            .map_err(|e| UploadError(StatusCode::BAD_REQUEST, format!("gzip: {e}")))?;
        crate::blocking(|| sink.write(&out))?;
    }
    crate::blocking(|| sink.finish(meta))
}

/// An upload's user metadata.
type Meta = std::collections::BTreeMap<String, String>;

/// A destination file being written, with the size cap enforced as bytes arrive.
struct Sink {
    file: std::fs::File,
    path: PathBuf,
    written: u64,
    limit: u64,
}

impl Sink {
    fn create(user: &User, path: &Path, limit: u64) -> Result<Sink, UploadError> {
        if path.is_dir() {
            return Err(UploadError(
                StatusCode::BAD_REQUEST,
                format!("path '{}' is a directory", path.display()),
            ));
        }
        if let Some(parent) = path.parent() {
            fs::create_dirs_owned(parent, user).map_err(|e| UploadError::io(e, parent))?;
        }
        let file = std::fs::File::create(path).map_err(|e| UploadError::io(e, path))?;
        fs::chown_to(path, user).map_err(|e| UploadError::io(e, path))?;
        Ok(Sink {
            file,
            path: path.to_path_buf(),
            written: 0,
            limit,
        })
    }

    fn write(&mut self, data: &[u8]) -> Result<(), UploadError> {
        self.written += data.len() as u64;
        if self.written > self.limit {
            let _ = std::fs::remove_file(&self.path);
            return Err(UploadError(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "upload to '{}' exceeds the {}-byte limit",
                    self.path.display(),
                    self.limit
                ),
            ));
        }
        self.file
            .write_all(data)
            .map_err(|e| UploadError::io(e, &self.path))
    }

    /// Ends the file with `meta` as its metadata (an empty map clears what an older file had).
    fn finish(self, meta: &Meta) -> Result<Value, UploadError> {
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Err(e) = crate::meta::replace(&self.path, meta)
            && !meta.is_empty()
        {
            return Err(UploadError::io(e, &self.path));
        }
        let mut v = json!({"name": name, "type": "file", "path": self.path.display().to_string()});
        if !meta.is_empty() {
            v["metadata"] = json!(meta);
        }
        Ok(v)
    }
}
