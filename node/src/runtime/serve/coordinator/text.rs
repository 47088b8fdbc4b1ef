//! The text shown to a requester as tokens come: never a stop sequence,
//! not even in part.

/// Where the text shown so far ends, and whether a stop sequence ended the
/// generation: before the first stop sequence in `text`; else, unless this
/// is the `last` step, before the longest tail of `text` that could still
/// grow into one (so no part of a stop sequence is ever shown); else all
/// of it.
pub(crate) fn shown_end(text: &str, stop: &[String], last: bool) -> (usize, bool) {
    if let Some(at) = stop.iter().filter_map(|s| text.find(s.as_str())).min() {
        return (at, true);
    }
    if last {
        return (text.len(), false);
    }
    // A character still missing bytes decodes as U+FFFD for now: hold it
    // back until its bytes arrive, or its replacement would be streamed.
    let text = text.trim_end_matches('\u{FFFD}');
    let held = stop
        .iter()
        .filter_map(|s| {
            (1..s.len())
                .rev()
                .find(|k| s.is_char_boundary(*k) && text.ends_with(&s[..*k]))
        })
        .max()
        .unwrap_or(0);
    (text.len() - held, false)
}

#[cfg(test)]
mod tests {
    use super::shown_end;

    #[test]
    fn a_stop_sequence_ends_the_text_before_it_and_is_never_shown_in_part() {
        let stop = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(shown_end("one two", &stop, false), (7, false));
        // A tail that may become a stop sequence is held back…
        assert_eq!(shown_end("one\n", &stop, false), (3, false));
        assert_eq!(shown_end("one EN", &stop, false), (4, false));
        // …and shown when it does not, or at the last step.
        assert_eq!(shown_end("one ENd", &stop, false), (7, false));
        assert_eq!(shown_end("one EN", &stop, true), (6, false));
        // The first stop sequence found ends the text.
        assert_eq!(shown_end("a END b\n\n", &stop, false), (2, true));
        assert_eq!(shown_end("a\n\nEND", &stop, true), (1, true));
        assert_eq!(shown_end("anything", &[], false), (8, false));
        // Held-back tails end on character boundaries.
        let stop = vec!["é!".to_string()];
        assert_eq!(shown_end("café", &stop, false), (3, false));
        // A character still missing bytes is held back until it is whole.
        assert_eq!(shown_end("caf\u{FFFD}", &[], false), (3, false));
        assert_eq!(shown_end("caf\u{FFFD}", &[], true), (6, false));
    }
}
