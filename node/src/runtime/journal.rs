//! The steward's decision journal (seed SPEC 001 §2.2) on redb.
//!
//! Records `{seq, prev, entry}` in deterministic CBOR, `prev` being the
//! BLAKE3 of the previous record's encoding; every append is its own durable
//! (fsynced) transaction. One steward per journal: the directory's lock file
//! is held with an OS lock for the steward's lifetime, released by the OS if
//! the process dies, and redb's own file lock backs it up. The chain's head
//! (last seq and record hash) is signed by the steward's key in the same
//! transaction, so an edited final record is caught too; only whole records
//! cut from the end together with an older head (a rollback) stay invisible
//! on disk, and the witness rule (a receipt the journal lacks) catches that.

use std::cell::Cell;
use std::fs::File;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};

use mesh_protocol::cbor::Cbor;
use mesh_protocol::mesh1::ContentId;
use mesh_protocol::{SigningKey, VerifyingKey};
use redb::{Database, ReadOnlyDatabase, ReadableDatabase, ReadableTable, TableDefinition};
use thiserror::Error;

mod entry;
pub use entry::{Entry, Judged, Judgement};

const RECORDS: TableDefinition<u64, &[u8]> = TableDefinition::new("journal_records");
/// One row (key 0): the signed head, `{seq, hash, steward, signature}`,
/// written in the same transaction as the records it covers. It makes an
/// edit of the last record detectable, which the chain alone cannot.
const HEAD: TableDefinition<u64, &[u8]> = TableDefinition::new("journal_head");
const HEAD_DOMAIN: &[u8] = b"mesh-node journal head v1";
/// Largest journal record accepted on read (a presentation of 8 grants plus
/// the request is a few KiB).
pub const MAX_RECORD_BYTES: usize = 256 * 1024;
/// Largest route table a `refused` entry keeps whole.
pub const MAX_REFUSAL_TABLE_BYTES: usize = 128 * 1024;
/// Most router refusals journalled a minute; more are counted, and the
/// next entry says how many.
pub const MAX_REFUSALS_JOURNALLED: u32 = 60;
/// The largest envelope kept in a `sealed` record (it must fit a record).
pub const MAX_KEPT_ENVELOPE_BYTES: usize = 192 * 1024;
/// The database file and the lock file in a journal directory.
pub const JOURNAL_FILE: &str = "journal.redb";
pub const LOCK_FILE: &str = "journal.lock";
/// The tail marker: the last record a write was confirmed for, written
/// beside the database after each commit. redb keeps two commit slots and
/// falls back to the older one when the newer is damaged: the database
/// then reads as whole, one transaction shorter, under a head signed for
/// that shorter chain. The marker is what tells.
pub const TAIL_FILE: &str = "journal.tail";
const TAIL_DOMAIN: &[u8] = b"mesh-node journal tail v1";

/// A record as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    pub prev: Option<ContentId>,
    pub entry: Entry,
}

#[derive(Debug, Error)]
pub enum JournalError {
    #[error("another steward holds the journal in {0} (one steward per journal); stop it first")]
    Locked(PathBuf),
    #[error("cannot use the journal directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "no journal in {0}: it holds no {JOURNAL_FILE} (give the directory a steward wrote its journal to)"
    )]
    NoJournal(PathBuf),
    #[error("the journal in {path} is corrupt: {why}")]
    Corrupt { path: PathBuf, why: String },
    #[error("journal storage: {0}")]
    Storage(String),
    #[error("journal record {seq} is malformed: {why}")]
    Malformed { seq: u64, why: String },
    #[error("journal records do not form one chain at record {seq}: {why}")]
    Broken { seq: u64, why: String },
    #[error(
        "the journal in {path} ends {}, but record {written} was written (its tail marker, {TAIL_FILE}, says so): the last records were lost to a damaged file or a rollback. Restore the journal from a copy; to go on without them, stop the node and run `mesh-node journal accept-loss --data DATA --key KEYFILE`, which records the loss in the journal",
        .last.map_or("before its first record".to_string(), |last| format!("at record {last}"))
    )]
    TailLost {
        path: PathBuf,
        last: Option<u64>,
        written: u64,
    },
}

/// What the tail marker says: the last record confirmed written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TailMark {
    seq: u64,
    hash: ContentId,
}

impl TailMark {
    /// `seq` (u64 BE) ‖ hash ‖ BLAKE3(domain ‖ seq ‖ hash): a marker that
    /// is garbled reads as none, never as a claim.
    fn encode(&self) -> Vec<u8> {
        let mut bytes = self.seq.to_be_bytes().to_vec();
        bytes.extend_from_slice(&self.hash);
        let check = Self::check(&bytes);
        bytes.extend_from_slice(&check);
        bytes
    }

    fn check(body: &[u8]) -> [u8; 32] {
        let mut hasher = blake3::Hasher::new();
        hasher.update(TAIL_DOMAIN);
        hasher.update(body);
        hasher.finalize().into()
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let (body, check) = bytes.split_at_checked(40)?;
        if check != Self::check(body) {
            return None;
        }
        let (seq, hash) = body.split_at(8);
        Some(Self {
            seq: u64::from_be_bytes(seq.try_into().ok()?),
            hash: hash.try_into().ok()?,
        })
    }

    /// The marker in `dir`; none when there is none or it is garbled (a
    /// write cut short by a crash), which checks nothing.
    fn read(dir: &Path) -> Option<Self> {
        let bytes = std::fs::read(dir.join(TAIL_FILE)).ok()?;
        let mark = Self::decode(&bytes);
        if mark.is_none() {
            tracing::warn!(
                "the journal's tail marker in {} is unreadable: the journal's end is not checked",
                dir.display()
            );
        }
        mark
    }

    /// Replace the marker (a new file renamed over the old, so a reader
    /// sees the old or the new whole). Not synced: written after the
    /// commit, it can only lag the database, never lead it, so a crash
    /// that loses it loses a check, not a record.
    fn write(&self, dir: &Path) {
        if let Err(error) = self.replace(dir, false) {
            tracing::warn!("the journal's tail marker was not written: {error}");
        }
    }

    /// Replace the marker, synced to disk (the file and the directory)
    /// when `sync`.
    fn replace(&self, dir: &Path, sync: bool) -> std::io::Result<()> {
        let temporary = dir.join(format!("{TAIL_FILE}.new"));
        let mut file = private_file(&temporary)?;
        {
            use std::io::Write;
            file.set_len(0)?;
            file.write_all(&self.encode())?;
        }
        if sync {
            file.sync_all()?;
        }
        std::fs::rename(&temporary, dir.join(TAIL_FILE))?;
        if sync {
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    }

    /// The journal's records against the marker: the record it names must
    /// be there, and be the one written, unless the journal records that
    /// its loss was accepted (a marker left from before then, its
    /// replacement lost in a crash).
    fn check_records(
        mark: Option<Self>,
        dir: &Path,
        records: &[Record],
    ) -> Result<(), JournalError> {
        let Some(mark) = mark else {
            return Ok(());
        };
        let superseded = records.iter().any(
            |record| matches!(record.entry, Entry::TailLost { written, .. } if written == mark.seq),
        );
        if superseded {
            return Ok(());
        }
        match usize::try_from(mark.seq).ok().and_then(|k| records.get(k)) {
            Some(record) if record.hash() == mark.hash => Ok(()),
            Some(_) => Err(JournalError::Broken {
                seq: mark.seq,
                why: format!(
                    "it is not the record written (the tail marker, {TAIL_FILE}, names another)"
                ),
            }),
            None => Err(JournalError::TailLost {
                path: dir.join(JOURNAL_FILE),
                last: records.last().map(|r| r.seq),
                written: mark.seq,
            }),
        }
    }
}

fn storage<E: std::fmt::Display>(error: E) -> JournalError {
    JournalError::Storage(error.to_string())
}

thread_local! {
    /// Set while [`guarded`] runs storage code on this thread: a panic there
    /// is reported as a corrupt journal, so its default message is not printed.
    static QUIET_PANICS: Cell<bool> = const { Cell::new(false) };
}

/// Run storage code over a journal file that may be corrupt. redb panics on
/// some malformed files (a slice index taken from a flipped length); that
/// panic is caught here and becomes [`JournalError::Corrupt`]. The panic
/// hook is wrapped once so that it stays silent only on this thread and only
/// while `work` runs; every other panic is reported as before.
fn guarded<T>(
    dir: &Path,
    work: impl FnOnce() -> Result<T, JournalError>,
) -> Result<T, JournalError> {
    static WRAP_HOOK: std::sync::Once = std::sync::Once::new();
    WRAP_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET_PANICS.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was_quiet = QUIET_PANICS.with(|q| q.replace(true));
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(work));
    QUIET_PANICS.with(|q| q.set(was_quiet));
    outcome.unwrap_or_else(|payload| {
        let why = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "the storage layer failed on its contents".into());
        let why = why.lines().next().unwrap_or_default();
        Err(JournalError::Corrupt {
            path: dir.join(JOURNAL_FILE),
            why: format!("unreadable storage structure ({why}); restore it from a copy"),
        })
    })
}

/// How long taking the journal's lock waits while it is held.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// `try_lock` again every 10 ms while the lock is held, for at most
/// [`LOCK_WAIT`]. A child this process spawns holds a copy of every open
/// descriptor, the lock file's included (and so the lock), from its fork
/// until it execs: a steward dropped and opened again, or a journal read
/// just after its steward stopped, can find the lock held for that moment
/// (CI saw it, with tests spawning processes beside each other). A lock
/// another steward holds is still refused, after the wait.
fn wait_for_lock(
    mut try_lock: impl FnMut() -> Result<(), std::fs::TryLockError>,
) -> Result<(), std::fs::TryLockError> {
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match try_lock() {
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// Create `dir` and any missing parents owner-only (0700 on unix). An
/// existing directory is left as it is.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder.create(dir)
}

/// Open (creating if need be) a journal file for reading and writing,
/// owner-only (0600 on unix), tightening an existing file's mode.
fn private_file(path: &Path) -> std::io::Result<File> {
    let mut options = File::options();
    options.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        options.mode(0o600);
        let file = options.open(path)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        Ok(file)
    }
    #[cfg(not(unix))]
    options.open(path)
}

/// A private scratch directory, removed on drop (`journal inspect` repairs
/// a copy of a journal that was not closed cleanly here, never the original).
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> std::io::Result<Self> {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!(
            "mesh-node-journal-{}-{n}-{nanos}",
            std::process::id()
        ));
        let mut builder = std::fs::DirBuilder::new();
        #[cfg(unix)]
        {
            use std::os::unix::fs::DirBuilderExt;
            builder.mode(0o700);
        }
        builder.create(&path)?;
        Ok(Self(path))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Record {
    pub fn encode(&self) -> Vec<u8> {
        let mut fields = vec![
            ("seq", Cbor::Uint(self.seq)),
            ("entry", self.entry.to_cbor()),
        ];
        if let Some(prev) = &self.prev {
            fields.push(("prev", Cbor::bytes(prev.to_vec())));
        }
        Cbor::text_map(fields).encode()
    }

    pub fn decode(bytes: &[u8], expected_seq: u64) -> Result<Self, JournalError> {
        let malformed = |why: String| JournalError::Malformed {
            seq: expected_seq,
            why,
        };
        if bytes.len() > MAX_RECORD_BYTES {
            return Err(malformed(format!(
                "{} bytes, over {MAX_RECORD_BYTES}",
                bytes.len()
            )));
        }
        let value = Cbor::decode(bytes).map_err(|e| malformed(e.to_string()))?;
        if let Cbor::Map(entries) = &value
            && entries
                .iter()
                .any(|(k, _)| !matches!(k.as_text(), Some("seq" | "entry" | "prev")))
        {
            return Err(malformed("unknown member".into()));
        }
        let seq = value
            .get("seq")
            .and_then(Cbor::as_uint)
            .ok_or_else(|| malformed("`seq`".into()))?;
        let prev = value
            .get("prev")
            .map(|p| {
                p.as_bytes()
                    .and_then(|b| b.try_into().ok())
                    .ok_or_else(|| malformed("`prev`".into()))
            })
            .transpose()?;
        let entry = Entry::from_cbor(
            value
                .get("entry")
                .ok_or_else(|| malformed("`entry`".into()))?,
        )
        .map_err(malformed)?;
        Ok(Self { seq, prev, entry })
    }

    pub fn hash(&self) -> ContentId {
        blake3::hash(&self.encode()).into()
    }
}

/// An open journal, held exclusively.
#[derive(Debug)]
pub struct Journal {
    /// `None` only after a failed write, until the next append reopens it.
    database: Option<Database>,
    key: SigningKey,
    _lock: File,
    dir: PathBuf,
    next_seq: u64,
    head: Option<ContentId>,
    fail_next_append: bool,
    /// A write failed (a full disk, an I/O error): redb refuses every later
    /// write on that handle, so the next append drops and reopens it.
    reopen: bool,
}

impl Journal {
    /// Open (or create) the journal in `dir` for the steward holding `key`,
    /// taking exclusive ownership. Returns the journal and its records,
    /// verified to form one chain under a head this key signed.
    pub fn open(dir: &Path, key: SigningKey) -> Result<(Self, Vec<Record>), JournalError> {
        let (journal, records, lost) = Self::open_checked(dir, key)?;
        match lost {
            Some(error) => Err(error),
            None => Ok((journal, records)),
        }
    }

    /// Open a journal whose tail was lost ([`JournalError::TailLost`]) and
    /// record the loss in it, so it opens again: the operator's way on
    /// when no copy holds the lost records (`mesh-node journal
    /// accept-loss`). The records it holds, and the loss recorded (`None`
    /// when nothing was lost).
    pub fn accept_loss(
        dir: &Path,
        key: SigningKey,
        now_ms: u64,
    ) -> Result<(Vec<Record>, Option<Record>), JournalError> {
        let (mut journal, records, lost) = Self::open_checked(dir, key)?;
        let Some(JournalError::TailLost { last, written, .. }) = lost else {
            return Ok((records, None));
        };
        let record = journal.append(Entry::TailLost {
            last,
            written,
            at_ms: now_ms,
        })?;
        // Synced: a marker left naming the lost record would read as a
        // journal that differs from the one written.
        TailMark {
            seq: record.seq,
            hash: record.hash(),
        }
        .replace(dir, true)
        .map_err(|source| JournalError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        Ok((records, Some(record)))
    }

    /// Open and read the journal; a lost tail is returned beside it rather
    /// than as the error.
    fn open_checked(
        dir: &Path,
        key: SigningKey,
    ) -> Result<(Self, Vec<Record>, Option<JournalError>), JournalError> {
        let (database, lock) = Self::lock_and_open(dir)?;
        let (records, head_key) = guarded(dir, || Self::read_all(&database))?;
        let lost = match TailMark::check_records(TailMark::read(dir), dir, &records) {
            Ok(()) => None,
            Err(lost @ JournalError::TailLost { .. }) => Some(lost),
            Err(error) => return Err(error),
        };
        if head_key.is_some_and(|k| k != key.verifying_key()) {
            return Err(JournalError::Broken {
                seq: records.len() as u64,
                why: "the head is signed by another steward's key".into(),
            });
        }
        let (next_seq, head) = match records.last() {
            Some(last) => (last.seq + 1, Some(last.hash())),
            None => (0, None),
        };
        Ok((
            Self {
                database: Some(database),
                key,
                _lock: lock,
                dir: dir.to_path_buf(),
                next_seq,
                head,
                fail_next_append: false,
                reopen: false,
            },
            records,
            lost,
        ))
    }

    /// Read a journal without a steward's key (for `journal inspect` while no
    /// steward runs): the chain and the head's signature are checked under
    /// the key the head names. Refuses if a steward holds the journal, and
    /// refuses a directory without one ([`JournalError::NoJournal`]).
    ///
    /// Read-only: nothing in `dir` is created or written. A journal whose
    /// steward died (so redb was not closed cleanly) needs redb's repair
    /// before it can be read; that repair runs on a private copy.
    pub fn read(dir: &Path) -> Result<Vec<Record>, JournalError> {
        let (records, lost) = Self::read_with_loss(dir)?;
        match lost {
            Some(lost) => Err(lost),
            None => Ok(records),
        }
    }

    /// `read`, with a lost tail ([`JournalError::TailLost`]) returned beside
    /// the records the journal holds, for an operator to see what remains.
    pub fn read_with_loss(dir: &Path) -> Result<(Vec<Record>, Option<JournalError>), JournalError> {
        let path = dir.join(JOURNAL_FILE);
        if !path.is_file() {
            return Err(JournalError::NoJournal(dir.to_path_buf()));
        }
        let _lock = Self::lock_shared(dir)?;
        let (records, _) = guarded(dir, || match ReadOnlyDatabase::open(&path) {
            Ok(database) => Self::read_all(&database),
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                Err(JournalError::Locked(dir.to_path_buf()))
            }
            Err(redb::DatabaseError::RepairAborted) => Self::read_repaired_copy(dir, &path),
            Err(error) => Err(storage(error)),
        })?;
        match TailMark::check_records(TailMark::read(dir), dir, &records) {
            Ok(()) => Ok((records, None)),
            Err(lost @ JournalError::TailLost { .. }) => Ok((records, Some(lost))),
            Err(error) => Err(error),
        }
    }

    /// Take the lock file shared, if there is one (a running steward holds
    /// it exclusively). Opens it read-only; creates nothing.
    fn lock_shared(dir: &Path) -> Result<Option<File>, JournalError> {
        let io = |source| JournalError::Io {
            path: dir.to_path_buf(),
            source,
        };
        let lock = match File::open(dir.join(LOCK_FILE)) {
            Ok(lock) => lock,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(io(error)),
        };
        match wait_for_lock(|| lock.try_lock_shared()) {
            Ok(()) => Ok(Some(lock)),
            Err(std::fs::TryLockError::WouldBlock) => Err(JournalError::Locked(dir.to_path_buf())),
            Err(std::fs::TryLockError::Error(error)) => Err(io(error)),
        }
    }

    /// Copy an unclosed journal into a private scratch directory, let redb
    /// repair the copy, and read that.
    fn read_repaired_copy(
        dir: &Path,
        path: &Path,
    ) -> Result<(Vec<Record>, Option<VerifyingKey>), JournalError> {
        let io = |source| JournalError::Io {
            path: dir.to_path_buf(),
            source,
        };
        let scratch = Scratch::new().map_err(io)?;
        let copy = scratch.0.join(JOURNAL_FILE);
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut target = options.open(&copy).map_err(io)?;
        std::io::copy(&mut File::open(path).map_err(io)?, &mut target).map_err(io)?;
        drop(target);
        let database = Database::open(&copy).map_err(storage)?;
        Self::read_all(&database)
    }

    fn lock_and_open(dir: &Path) -> Result<(Database, File), JournalError> {
        let io = |source| JournalError::Io {
            path: dir.to_path_buf(),
            source,
        };
        create_private_dir(dir).map_err(io)?;
        let lock = private_file(&dir.join(LOCK_FILE)).map_err(io)?;
        match wait_for_lock(|| lock.try_lock()) {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(JournalError::Locked(dir.to_path_buf()));
            }
            Err(std::fs::TryLockError::Error(error)) => return Err(io(error)),
        }
        // Created (or tightened) owner-only before redb opens it: records
        // hold request ids and presentations.
        let file = private_file(&dir.join(JOURNAL_FILE)).map_err(io)?;
        let database = guarded(dir, || match Database::builder().create_file(file) {
            Ok(database) => Ok(database),
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                Err(JournalError::Locked(dir.to_path_buf()))
            }
            Err(error) => Err(storage(error)),
        })?;
        Ok((database, lock))
    }

    fn head_message(seq: u64, hash: &ContentId) -> Vec<u8> {
        let mut message = HEAD_DOMAIN.to_vec();
        message.extend_from_slice(&seq.to_be_bytes());
        message.extend_from_slice(hash);
        message
    }

    fn encode_head(&self, seq: u64, hash: &ContentId) -> Vec<u8> {
        use ed25519_dalek::Signer;
        let signature = self.key.sign(&Self::head_message(seq, hash));
        Cbor::text_map([
            ("seq", Cbor::Uint(seq)),
            ("hash", Cbor::bytes(hash.to_vec())),
            (
                "steward",
                Cbor::bytes(self.key.verifying_key().to_bytes().to_vec()),
            ),
            ("signature", Cbor::bytes(signature.to_bytes().to_vec())),
        ])
        .encode()
    }

    /// Check the signed head against the last record; returns the key that signed it.
    fn check_head(
        bytes: Option<&[u8]>,
        last: Option<&Record>,
    ) -> Result<Option<VerifyingKey>, JournalError> {
        let seq = last.map_or(0, |r| r.seq + 1);
        let broken = |why: &str| JournalError::Broken {
            seq,
            why: why.to_string(),
        };
        let (bytes, last) = match (bytes, last) {
            (None, None) => return Ok(None),
            (Some(bytes), Some(last)) => (bytes, last),
            (None, Some(_)) => return Err(broken("records without a signed head")),
            (Some(_), None) => return Err(broken("a signed head without records")),
        };
        let head = Cbor::decode(bytes).map_err(|_| broken("the head is malformed"))?;
        let field = |k: &str| head.get(k).and_then(Cbor::as_bytes);
        let key: [u8; 32] = field("steward")
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| broken("the head is malformed"))?;
        let signature: [u8; 64] = field("signature")
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| broken("the head is malformed"))?;
        let hash: ContentId = field("hash")
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| broken("the head is malformed"))?;
        if head.get("seq").and_then(Cbor::as_uint) != Some(last.seq) || hash != last.hash() {
            return Err(broken(
                "the last record is not the one the signed head names",
            ));
        }
        let key =
            VerifyingKey::from_bytes(&key).map_err(|_| broken("the head names no valid key"))?;
        key.verify_strict(
            &Self::head_message(last.seq, &hash),
            &ed25519_dalek::Signature::from_bytes(&signature),
        )
        .map_err(|_| broken("the head's signature does not verify"))?;
        Ok(Some(key))
    }

    fn read_all(
        database: &impl ReadableDatabase,
    ) -> Result<(Vec<Record>, Option<VerifyingKey>), JournalError> {
        let read = database.begin_read().map_err(storage)?;
        let head = match read.open_table(HEAD) {
            Ok(table) => table
                .get(0u64)
                .map_err(storage)?
                .map(|v| v.value().to_vec()),
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(error) => return Err(storage(error)),
        };
        let table = match read.open_table(RECORDS) {
            Ok(table) => table,
            Err(redb::TableError::TableDoesNotExist(_)) => {
                return Self::check_head(head.as_deref(), None).map(|key| (Vec::new(), key));
            }
            Err(error) => return Err(storage(error)),
        };
        let mut records: Vec<Record> = Vec::new();
        for (expected, item) in (0u64..).zip(table.iter().map_err(storage)?) {
            let (key, value) = item.map_err(storage)?;
            if key.value() != expected {
                return Err(JournalError::Broken {
                    seq: expected,
                    why: format!("record {} is missing", expected),
                });
            }
            let record = Record::decode(value.value(), expected)?;
            if record.seq != expected {
                return Err(JournalError::Broken {
                    seq: expected,
                    why: format!("stored under {expected} but says {}", record.seq),
                });
            }
            let prev = records.last().map(Record::hash);
            if record.prev != prev {
                return Err(JournalError::Broken {
                    seq: expected,
                    why: "`prev` is not the hash of the previous record".into(),
                });
            }
            records.push(record);
        }
        let key = Self::check_head(head.as_deref(), records.last())?;
        Ok((records, key))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Append one entry durably; returns its record.
    pub fn append(&mut self, entry: Entry) -> Result<Record, JournalError> {
        self.append_all(vec![entry])
            .map(|mut records| records.remove(0))
    }

    /// Append several entries in one durable transaction (one fsync). After
    /// a failed write this first reopens the database (see [`Self::reopen`]).
    pub fn append_all(&mut self, entries: Vec<Entry>) -> Result<Vec<Record>, JournalError> {
        if std::mem::take(&mut self.fail_next_append) {
            return Err(JournalError::Storage("injected failure (test)".into()));
        }
        if self.reopen || self.database.is_none() {
            self.reopen()?;
        }
        let mut records = Vec::with_capacity(entries.len());
        let (mut seq, mut prev) = (self.next_seq, self.head);
        for entry in entries {
            let record = Record { seq, prev, entry };
            prev = Some(record.hash());
            seq += 1;
            records.push(record);
        }
        let head = match (records.last(), prev) {
            (Some(last), Some(hash)) => Some(self.encode_head(last.seq, &hash)),
            _ => None,
        };
        let database = self.database.as_ref().ok_or_else(|| storage("not open"))?;
        let written = guarded(&self.dir, || {
            let write = database.begin_write().map_err(storage)?;
            {
                let mut table = write.open_table(RECORDS).map_err(storage)?;
                for record in &records {
                    table
                        .insert(record.seq, record.encode().as_slice())
                        .map_err(storage)?;
                }
                if let Some(head) = &head {
                    let mut table = write.open_table(HEAD).map_err(storage)?;
                    table.insert(0u64, head.as_slice()).map_err(storage)?;
                }
            }
            write.commit().map_err(storage)
        });
        if let Err(error) = written {
            self.reopen = true;
            return Err(error);
        }
        self.next_seq = seq;
        self.head = prev;
        if let (Some(last), Some(hash)) = (records.last(), prev) {
            TailMark {
                seq: last.seq,
                hash,
            }
            .write(&self.dir);
        }
        Ok(records)
    }

    /// Drop the database handle and open the file again, as after a failed
    /// write (redb refuses every write on a handle that saw an I/O error,
    /// so a freed disk would otherwise never be used again). The reopened
    /// journal must end where this one believes it does; if the failed write
    /// reached the disk after all, appends stay refused until a restart
    /// replays the journal.
    pub fn reopen(&mut self) -> Result<(), JournalError> {
        self.reopen = true;
        // redb holds its own lock on the file: release it before reopening.
        self.database = None;
        let dir = self.dir.clone();
        let database = guarded(&dir, || {
            Database::create(dir.join(JOURNAL_FILE)).map_err(storage)
        })?;
        let (records, _) = guarded(&dir, || Self::read_all(&database))?;
        if records.len() as u64 != self.next_seq || records.last().map(Record::hash) != self.head {
            return Err(JournalError::Storage(format!(
                "after a failed write the journal holds {} record(s) where this steward confirmed {}; \
                 restart the steward so it replays the journal",
                records.len(),
                self.next_seq
            )));
        }
        self.database = Some(database);
        self.reopen = false;
        Ok(())
    }

    /// Make the next append fail, as a full or failing disk would (tests of
    /// the refuse-when-not-journalled rules only).
    #[doc(hidden)]
    pub fn inject_append_failure(&mut self) {
        self.fail_next_append = true;
    }

    /// Replace one stored record's bytes (tests of tamper detection only).
    #[doc(hidden)]
    pub fn overwrite_raw(dir: &Path, seq: u64, bytes: Option<&[u8]>) -> Result<(), JournalError> {
        let (database, _lock) = Self::lock_and_open(dir)?;
        let write = database.begin_write().map_err(storage)?;
        {
            let mut table = write.open_table(RECORDS).map_err(storage)?;
            match bytes {
                Some(bytes) => {
                    table.insert(seq, bytes).map_err(storage)?;
                }
                None => {
                    table.remove(seq).map_err(storage)?;
                }
            }
        }
        write.commit().map_err(storage)?;
        Ok(())
    }

    /// The raw bytes of one record (tests of tamper detection only).
    #[doc(hidden)]
    pub fn raw(dir: &Path, seq: u64) -> Result<Option<Vec<u8>>, JournalError> {
        let (database, _lock) = Self::lock_and_open(dir)?;
        let read = database.begin_read().map_err(storage)?;
        let table = read.open_table(RECORDS).map_err(storage)?;
        Ok(table.get(seq).map_err(storage)?.map(|v| v.value().to_vec()))
    }
}
