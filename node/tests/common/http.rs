//! A minimal HTTP/1.1 client for the tests (one exchange per connection,
//! `Connection: close`), so they need no HTTP client crate.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

/// One exchange: the status and the body's JSON (the text between its
/// first `{` and last `}`, which also reads a chunked body of one object;
/// `Null` when there is none).
pub fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> std::io::Result<(u16, Value)> {
    let body = body.map(Value::to_string).unwrap_or_default();
    let (status, text) = exchange(addr, method, path, body.as_bytes())?;
    let json = match (text.find('{'), text.rfind('}')) {
        (Some(a), Some(b)) if b > a => serde_json::from_str(&text[a..=b]).unwrap_or(Value::Null),
        _ => Value::Null,
    };
    Ok((status, json))
}

/// One exchange with a raw JSON body: the status and the body as text.
pub fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    exchange_as(addr, method, path, "application/json", body)
}

/// One exchange with a raw body of `content_type`.
pub fn exchange_as(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    exchange_with(addr, method, path, &[("Content-Type", content_type)], body)
}

/// One request with exactly the headers given (besides Host, the length
/// and `Connection: close`): the status and the body.
pub fn exchange_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    stream.write_all(head.as_bytes())?;
    // A server may answer (413) before reading all of a large body and
    // close: what it answered is still read.
    let _ = stream.write_all(body);
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, rest.to_string()))
}

/// A TCP connection to `to` from loopback address `source` (127.0.0.0/8 is
/// all loopback on Linux): how a test plays several clients on one machine.
pub fn connect_from(source: std::net::IpAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&SocketAddr::new(source, 0).into())?;
    socket.connect_timeout(&to.into(), Duration::from_secs(5))?;
    Ok(socket.into())
}

/// `exchange_as`, from loopback address `source`, with `host` as the Host
/// header and a read timeout of `within`.
pub fn exchange_from(
    source: std::net::IpAddr,
    addr: SocketAddr,
    (method, path, host): (&str, &str, &str),
    body: &[u8],
    within: Duration,
) -> std::io::Result<(u16, String)> {
    let mut stream = connect_from(source, addr)?;
    stream.set_read_timeout(Some(within))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    let _ = stream.write_all(body);
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, rest.to_string()))
}
