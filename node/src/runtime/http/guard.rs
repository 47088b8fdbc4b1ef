//! Who may talk to the API from a web browser: the `Host` a request names
//! (against DNS rebinding) and the origins given CORS.
//!
//! A page on another site cannot read the API's answers (no CORS header
//! names its origin), but it can make the browser resolve its own domain
//! to 127.0.0.1 a moment later (DNS rebinding) and then talk to a node
//! bound there as if it were its own site. What gives it away is the
//! `Host` header: the attacker's domain. So the API answers only a `Host`
//! that is an IP address (a literal address cannot be rebound), `localhost`
//! (or a name under `.localhost`, which browsers resolve to loopback
//! themselves), or a name the operator allowed (`--http-allow-host`), as
//! Ollama does; anything else is refused with 403 before any handler runs.
//! CORS is off unless origins are configured (`--http-allow-origin`).

use std::net::IpAddr;

use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, Response, StatusCode, header};
use serde_json::json;

/// What the API lets browsers do; the default allows IP literals and
/// `localhost` as hosts, and no cross-origin reads.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Host names answered besides IP literals and `localhost`: exact
    /// (case-insensitive), `.example.com` for any name under it, or `*`
    /// for any host at all.
    pub allow_hosts: Vec<String>,
    /// Origins given CORS (`https://app.example.com`), or `*` for any.
    pub allow_origins: Vec<String>,
}

/// What the check decided for one request.
#[derive(Debug)]
pub enum Checked {
    /// Refused before any handler: its response.
    Refused(Response<Body>),
    /// A CORS preflight, answered here.
    Preflight(Response<Body>),
    /// Let through; the CORS headers its response gets (none when not
    /// cross-origin or not allowed).
    Allowed(Cors),
}

/// The CORS headers a response gets.
#[derive(Debug)]
pub struct Cors(Option<HeaderValue>);

impl Cors {
    pub fn apply(self, response: &mut Response<Body>) {
        if let Some(origin) = self.0 {
            let headers = response.headers_mut();
            headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
            headers.append(header::VARY, HeaderValue::from_static("origin"));
        }
    }
}

/// An error in OpenAI's shape, answered before any handler runs.
pub(super) fn refusal(status: StatusCode, message: String) -> Response<Body> {
    let code = match status {
        StatusCode::FORBIDDEN => "forbidden",
        _ => "request_too_large",
    };
    let body = json!({"error": {
        "message": message,
        "type": "invalid_request_error",
        "param": null,
        "code": code,
    }});
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_default()
}

/// The host part of a `Host` value: without its port, lower-case, without
/// a trailing dot; an IPv6 literal without its brackets.
fn host_name(value: &str) -> String {
    let value = value.trim();
    let name = if let Some(rest) = value.strip_prefix('[') {
        rest.split(']').next().unwrap_or_default()
    } else {
        match value.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => value,
        }
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

impl Access {
    fn host_allowed(&self, name: &str) -> bool {
        name.parse::<IpAddr>().is_ok()
            || name == "localhost"
            || name.ends_with(".localhost")
            || self.allow_hosts.iter().any(|allowed| {
                // A configured name with a port matches the name.
                let allowed = if allowed.trim().starts_with('.') {
                    allowed.trim().trim_end_matches('.').to_ascii_lowercase()
                } else {
                    host_name(allowed)
                };
                allowed == "*"
                    || allowed == name
                    || (allowed.starts_with('.') && name.ends_with(allowed.as_str()))
            })
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        self.allow_origins
            .iter()
            .any(|allowed| allowed == "*" || allowed.eq_ignore_ascii_case(origin))
    }

    /// Decide on one request from its head.
    pub fn check<B>(&self, request: &Request<B>) -> Checked {
        let host = match request.headers().get(header::HOST) {
            Some(value) => match value.to_str() {
                Ok(host) => Some(host.to_string()),
                // Bytes a browser never sends: not a name this API answers.
                Err(_) => {
                    return Checked::Refused(refusal(
                        StatusCode::FORBIDDEN,
                        "the Host header is not a host name".into(),
                    ));
                }
            },
            None => request.uri().authority().map(|a| a.to_string()),
        };
        // A request without a Host is no browser's (HTTP/1.1 browsers always
        // send one).
        if let Some(host) = host {
            let name = host_name(&host);
            if !self.host_allowed(&name) {
                return Checked::Refused(refusal(
                    StatusCode::FORBIDDEN,
                    format!(
                        "this API does not answer requests for host `{name}` (a page that \
                         rebinds its name to this address would send it); to allow it, start \
                         the node with --http-allow-host {name}"
                    ),
                ));
            }
        }
        let origin = request
            .headers()
            .get(header::ORIGIN)
            .filter(|origin| origin.to_str().is_ok_and(|o| self.origin_allowed(o)))
            .cloned();
        let preflight = request.method() == Method::OPTIONS
            && request
                .headers()
                .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
        if !preflight {
            return Checked::Allowed(Cors(origin));
        }
        let Some(origin) = origin else {
            return Checked::Refused(refusal(
                StatusCode::FORBIDDEN,
                "cross-origin requests are not allowed from this origin; start the node with \
                 --http-allow-origin ORIGIN to allow one"
                    .into(),
            ));
        };
        let response = Response::builder()
            .status(StatusCode::NO_CONTENT)
            .header(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin)
            .header(header::VARY, "origin")
            .header(header::ACCESS_CONTROL_ALLOW_METHODS, "GET, POST, OPTIONS")
            .header(
                header::ACCESS_CONTROL_ALLOW_HEADERS,
                "authorization, content-type",
            )
            .header(header::ACCESS_CONTROL_MAX_AGE, "600")
            .body(Body::empty())
            .unwrap_or_default();
        Checked::Preflight(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(host: &str, origin: Option<&str>, method: Method) -> Request<Body> {
        let mut builder = Request::builder()
            .method(method.clone())
            .uri("/v1/models")
            .header(header::HOST, host);
        if let Some(origin) = origin {
            builder = builder.header(header::ORIGIN, origin);
        }
        if method == Method::OPTIONS {
            builder = builder.header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST");
        }
        builder.body(Body::empty()).unwrap()
    }

    fn allowed(access: &Access, host: &str) -> bool {
        matches!(
            access.check(&request(host, None, Method::GET)),
            Checked::Allowed(_)
        )
    }

    #[test]
    fn ip_literals_and_localhost_are_answered_other_names_only_when_allowed() {
        let access = Access::default();
        for host in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "[::1]:8080",
            "10.1.2.3:80",
            "localhost:8080",
            "LOCALHOST.",
            "app.localhost:3000",
        ] {
            assert!(allowed(&access, host), "{host}");
        }
        for host in [
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
        ] {
            assert!(!allowed(&access, host), "{host}");
        }
        let access = Access {
            allow_hosts: vec![
                "Node.LAN".into(),
                ".example.com".into(),
                "box.lan:8080".into(),
            ],
            ..Access::default()
        };
        assert!(allowed(&access, "node.lan:8080"));
        assert!(allowed(&access, "box.lan:9000"));
        assert!(allowed(&access, "api.example.com"));
        assert!(!allowed(&access, "example.org"));
        let any = Access {
            allow_hosts: vec!["*".into()],
            ..Access::default()
        };
        assert!(allowed(&any, "anything.at.all"));
    }

    #[test]
    fn cors_is_off_unless_an_origin_is_configured() {
        let access = Access::default();
        let Checked::Allowed(cors) = access.check(&request(
            "127.0.0.1",
            Some("https://a.example"),
            Method::GET,
        )) else {
            panic!("a simple request is let through");
        };
        let mut response = Response::new(Body::empty());
        cors.apply(&mut response);
        assert!(
            !response
                .headers()
                .contains_key(header::ACCESS_CONTROL_ALLOW_ORIGIN)
        );
        assert!(matches!(
            access.check(&request(
                "127.0.0.1",
                Some("https://a.example"),
                Method::OPTIONS
            )),
            Checked::Refused(_)
        ));
        let access = Access {
            allow_origins: vec!["https://a.example".into()],
            ..Access::default()
        };
        let Checked::Preflight(response) = access.check(&request(
            "127.0.0.1",
            Some("https://a.example"),
            Method::OPTIONS,
        )) else {
            panic!("a preflight from an allowed origin is answered");
        };
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        assert_eq!(
            response.headers()[header::ACCESS_CONTROL_ALLOW_ORIGIN],
            "https://a.example"
        );
    }
}
