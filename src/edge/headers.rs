//! Request header checks that run before any body byte is read (pure functions).

use axum::http::{HeaderMap, header};

use crate::edge::{ApiError, ErrorCode};
use crate::ids::{SessionId, SessionKey, TenantId};

/// Header naming the tenant of an upload session.
pub const TENANT_HEADER: &str = "x-graviton-tenant-id";
/// Header naming the upload session.
pub const SESSION_HEADER: &str = "x-graviton-upload-session-id";
/// RFC 9530 digest of the whole body (`sha-256=:<base64>:`).
pub const CONTENT_DIGEST_HEADER: &str = "content-digest";
/// The compatibility spelling of the body's SHA-256 (hex).
pub const CONTENT_HASH_HEADER: &str = "x-content-hash";

/// Everything an upload needs to know from its headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadHeaders {
    /// Declared body length, if any.
    pub content_length: Option<u64>,
    /// The session, when both locality headers are present.
    pub session: Option<SessionKey>,
    /// The SHA-256 the client declared for the body, when it did.
    pub digest: Option<crate::cas::digest::ContentDigest>,
}

pub(crate) fn single_value<'a>(
    headers: &'a HeaderMap,
    name: &str,
    code: ErrorCode,
) -> Result<Option<&'a str>, ApiError> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::new(
            code,
            format!("{name} must appear at most once"),
        ));
    }
    first
        .to_str()
        .map(Some)
        .map_err(|_| ApiError::new(code, format!("{name} must be visible ASCII")))
}

/// Digits only (no sign, no spaces), fitting in u64. The one parser of numeric headers.
pub fn parse_digits(value: &[u8]) -> Option<u64> {
    if value.is_empty() || value.len() > 20 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// `Content-Length` must be ASCII digits only (no sign, spaces, or list).
pub fn content_length(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    const CODE: ErrorCode = ErrorCode::InvalidContentLength;
    let Some(value) = single_value(headers, header::CONTENT_LENGTH.as_str(), CODE)? else {
        return Ok(None);
    };
    parse_digits(value.as_bytes()).map(Some).ok_or_else(|| {
        ApiError::new(
            CODE,
            "Content-Length must be ASCII digits only, within 64 bits",
        )
    })
}

/// Both locality headers or neither; each a canonical UUID.
pub fn session_key(headers: &HeaderMap) -> Result<Option<SessionKey>, ApiError> {
    let tenant = single_value(headers, TENANT_HEADER, ErrorCode::InvalidTenantId)?;
    let session = single_value(headers, SESSION_HEADER, ErrorCode::InvalidSessionId)?;
    match (tenant, session) {
        (None, None) => Ok(None),
        (Some(_), None) | (None, Some(_)) => Err(ApiError::new(
            ErrorCode::IncompleteSessionHeaders,
            "X-Graviton-Tenant-Id and X-Graviton-Upload-Session-Id must be sent together",
        )),
        (Some(tenant), Some(session)) => {
            let tenant: TenantId = tenant.parse().map_err(|e| {
                ApiError::new(
                    ErrorCode::InvalidTenantId,
                    format!("X-Graviton-Tenant-Id {e}"),
                )
            })?;
            let session: SessionId = session.parse().map_err(|e| {
                ApiError::new(
                    ErrorCode::InvalidSessionId,
                    format!("X-Graviton-Upload-Session-Id {e}"),
                )
            })?;
            Ok(Some(SessionKey { tenant, session }))
        }
    }
}

/// Refuse bodies that are clearly not a raw blob (a multipart form would be stored as
/// its envelope). Any other type, or none, is accepted as opaque bytes.
pub fn content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = single_value(
        headers,
        header::CONTENT_TYPE.as_str(),
        ErrorCode::InvalidContentType,
    )?
    else {
        return Ok(());
    };
    if value.trim().to_ascii_lowercase().starts_with("multipart/") {
        return Err(ApiError::new(
            ErrorCode::UnsupportedMediaType,
            "send the blob as the raw request body (for curl: --data-binary @FILE), not as a multipart form",
        ));
    }
    Ok(())
}

/// Why an `Authorization` header holds no bearer token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BearerError {
    /// No `Authorization` header, or more than one.
    Missing,
    /// Not `Bearer <token>` (another scheme, an empty token, not visible ASCII).
    Malformed,
}

/// The bearer token of the one `Authorization: Bearer <token>` header (the scheme is
/// case-insensitive). Every bearer check (tokens, the admin token, the internal token)
/// reads it here.
pub fn bearer_token(headers: &HeaderMap) -> Result<&str, BearerError> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(BearerError::Missing);
    };
    let text = value.to_str().map_err(|_| BearerError::Malformed)?;
    let (scheme, token) = text.split_once(' ').ok_or(BearerError::Malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(BearerError::Malformed);
    }
    Ok(token.trim())
}

/// All header checks of `POST /v1/blobs`, in order, plus the size limit.
pub fn upload_headers(headers: &HeaderMap, max_blob_size: u64) -> Result<UploadHeaders, ApiError> {
    let content_length = content_length(headers)?;
    if let Some(length) = content_length
        && length > max_blob_size
    {
        return Err(ApiError::blob_too_large());
    }
    content_type(headers)?;
    let session = session_key(headers)?;
    let digest = content_digest(headers)?;
    Ok(UploadHeaders {
        content_length,
        session,
        digest,
    })
}

/// The body's declared SHA-256 from `Content-Digest` and/or `X-Content-Hash` (400
/// `invalid_digest` when malformed, unsupported or conflicting).
pub fn content_digest(
    headers: &HeaderMap,
) -> Result<Option<crate::cas::digest::ContentDigest>, ApiError> {
    let rfc = single_value(headers, CONTENT_DIGEST_HEADER, ErrorCode::InvalidDigest)?;
    let hex = single_value(headers, CONTENT_HASH_HEADER, ErrorCode::InvalidDigest)?;
    crate::cas::digest::declared(rfc, hex)
        .map_err(|e| ApiError::new(ErrorCode::InvalidDigest, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    const T: &str = "0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f";
    const S: &str = "01890a5d-ac96-774b-bcce-b302099a8057";

    #[test]
    fn bearer_extraction_refuses_other_schemes_and_duplicates() {
        use axum::http::HeaderValue;
        let mut headers = HeaderMap::new();
        assert_eq!(bearer_token(&headers), Err(BearerError::Missing));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(bearer_token(&headers), Err(BearerError::Malformed));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer  "));
        assert_eq!(bearer_token(&headers), Err(BearerError::Malformed));
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer a.b.c"),
        );
        assert_eq!(bearer_token(&headers), Ok("a.b.c"));
        headers.append(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer x.y.z"),
        );
        assert_eq!(bearer_token(&headers), Err(BearerError::Missing));
    }

    #[test]
    fn digits_only() {
        assert_eq!(parse_digits(b"0"), Some(0));
        assert_eq!(parse_digits(b"007"), Some(7));
        assert_eq!(parse_digits(b"18446744073709551615"), Some(u64::MAX));
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b" 1",
            b"1 ",
            b"1e3",
            b"0x1",
            b"18446744073709551616",
            "١".as_bytes(),
        ] {
            assert_eq!(parse_digits(bad), None, "{bad:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn digits_round_trip_and_anything_else_is_refused(n in proptest::prelude::any::<u64>(), junk in "[^0-9]{1,4}", at in 0usize..20) {
            let text = n.to_string();
            proptest::prop_assert_eq!(parse_digits(text.as_bytes()), Some(n));
            let cut = at.min(text.len());
            let bad = format!("{}{}{}", &text[..cut], junk, &text[cut..]);
            proptest::prop_assert_eq!(parse_digits(bad.as_bytes()), None);
        }
    }

    #[test]
    fn content_length_accepts_only_digits() {
        assert_eq!(
            content_length(&headers(&[("content-length", "123")])).unwrap(),
            Some(123)
        );
        assert_eq!(content_length(&HeaderMap::new()).unwrap(), None);
        for bad in [
            "+1",
            "-1",
            "1 ",
            "0x10",
            "1,1",
            "",
            "99999999999999999999999",
        ] {
            let err = content_length(&headers(&[("content-length", bad)])).unwrap_err();
            assert_eq!(err.code.as_str(), "invalid_content_length", "{bad:?}");
        }
        let err = content_length(&headers(&[
            ("content-length", "1"),
            ("content-length", "1"),
        ]))
        .unwrap_err();
        assert_eq!(err.code.as_str(), "invalid_content_length");
    }

    #[test]
    fn locality_headers_are_both_or_none() {
        assert_eq!(session_key(&HeaderMap::new()).unwrap(), None);
        let key = session_key(&headers(&[(TENANT_HEADER, T), (SESSION_HEADER, S)]))
            .unwrap()
            .unwrap();
        assert_eq!(key.session.to_string(), S);
        assert_eq!(
            session_key(&headers(&[(TENANT_HEADER, T)]))
                .unwrap_err()
                .code
                .as_str(),
            "incomplete_session_headers"
        );
        assert_eq!(
            session_key(&headers(&[(SESSION_HEADER, S)]))
                .unwrap_err()
                .code
                .as_str(),
            "incomplete_session_headers"
        );
        assert_eq!(
            session_key(&headers(&[
                (TENANT_HEADER, "tenant-1"),
                (SESSION_HEADER, S)
            ]))
            .unwrap_err()
            .code
            .as_str(),
            "invalid_tenant_id"
        );
        assert_eq!(
            session_key(&headers(&[(TENANT_HEADER, T), (SESSION_HEADER, "{x}")]))
                .unwrap_err()
                .code
                .as_str(),
            "invalid_session_id"
        );
    }

    #[test]
    fn size_limit_and_multipart_are_refused_up_front() {
        let err = upload_headers(&headers(&[("content-length", "1001")]), 1000).unwrap_err();
        assert_eq!(err.code, ErrorCode::BlobTooLarge);
        let err = upload_headers(
            &headers(&[("content-type", "multipart/form-data; boundary=x")]),
            1000,
        )
        .unwrap_err();
        assert_eq!(err.code, ErrorCode::UnsupportedMediaType);
        assert!(
            upload_headers(
                &headers(&[("content-type", "application/x-www-form-urlencoded")]),
                1000
            )
            .is_ok()
        );
    }
}
