//! Typed decisions (seed SPEC 001 §3.6): a choice of one of a question's
//! options about the state a prompt holds, answered with a probability per
//! option and no generated text, in one forward pass through the chain:
//! the prompt (state, question, options, then `Answer:`) is prefilled and
//! the options are scored at its last position. Nothing is sampled and no
//! token is emitted.
//!
//! How an option is scored depends on what the tokenizer allows, decided
//! the same way every time:
//! - by its own first token (cloze scoring, which small models do well):
//!   when every option begins with a token no other option begins with;
//! - otherwise by a letter it is listed under (multiple-choice scoring):
//!   when the options' first tokens collide.
//!
//! Either way an option's probability is the model's next-token
//! probability of its token, renormalised over the options' tokens. An
//! option longer than one token is scored by its first: the figure says
//! which option the model starts to answer with, not how likely the whole
//! text is.

use mesh_protocol::control::DecisionAsk;
use mesh_stage::text::TextCodec;
use serde_json::json;

/// The letters options are listed under when they are scored by letter,
/// in order; a tokenizer that does not encode one as a single token after
/// the cue skips it.
const LETTERS: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
/// What the prompt ends with: the next token begins the answer.
const ANSWER_CUE: &str = "Answer:";

/// How the options were scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scoring {
    FirstToken,
    Letter,
}

impl Scoring {
    fn as_str(self) -> &'static str {
        match self {
            Scoring::FirstToken => "first token of each option",
            Scoring::Letter => "letter of each option",
        }
    }
}

/// A decision ready to run: its prompt, the token each option is scored
/// by (and the letter it is listed under, when scored by letter), and how
/// many of the prompt's tokens are the question's schema.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DecisionPlan {
    pub text: String,
    /// `text`, encoded.
    pub prompt_ids: Vec<u32>,
    pub question: String,
    pub options: Vec<String>,
    pub scoring: Scoring,
    pub labels: Vec<(Option<char>, u32)>,
    pub schema_tokens: u32,
}

/// The prompt a decision runs on: the state, then the question with its
/// options, then the cue; through the model's chat template when `chat`.
/// Its schema is every token the state alone does not give.
pub(crate) fn plan(
    codec: &TextCodec,
    state: &str,
    ask: &DecisionAsk,
    chat: bool,
    vocab: usize,
) -> anyhow::Result<DecisionPlan> {
    // The answer's token follows the cue: " Paris" after "Answer:" in a
    // BPE vocabulary; a tokenizer without such tokens (bytes) gets the
    // space in the cue instead.
    let cues = [
        (ANSWER_CUE.to_string(), " "),
        (format!("{ANSWER_CUE} "), ""),
    ];
    let mut chosen = None;
    for (cue, gap) in &cues {
        let firsts = first_tokens(codec, cue, gap, ask.options.iter().map(String::as_str))?;
        if distinct(&firsts) {
            chosen = Some((
                Scoring::FirstToken,
                cue.clone(),
                firsts
                    .into_iter()
                    .map(|t| (None, t.unwrap_or(0)))
                    .collect::<Vec<_>>(),
            ));
            break;
        }
    }
    if chosen.is_none() {
        let mut most = 0;
        for (cue, gap) in &cues {
            let letters = single_token_letters(codec, cue, gap, ask.options.len())?;
            most = most.max(letters.len());
            if letters.len() == ask.options.len() {
                chosen = Some((Scoring::Letter, cue.clone(), letters));
                break;
            }
        }
        if chosen.is_none() {
            anyhow::bail!(
                "the options begin with the same token, and this model's tokenizer gives {most} \
                 single-token letters to list them under: reword the options so each begins \
                 differently, or ask with at most {most}"
            );
        }
    }
    let Some((scoring, cue, labels)) = chosen else {
        anyhow::bail!("no way to score the options");
    };
    // Every token scored is one the output head gives a logit for.
    if labels.iter().any(|(_, token)| *token as usize >= vocab) {
        anyhow::bail!("an option's token is outside the model's {vocab}-token vocabulary");
    }
    let mut question = format!("{state}\n\nQuestion: {}\nOptions:\n", ask.question);
    for ((letter, _), option) in labels.iter().zip(&ask.options) {
        match letter {
            Some(letter) => question.push_str(&format!("{letter}. {option}\n")),
            None => question.push_str(&format!("- {option}\n")),
        }
    }
    question.push_str(match scoring {
        Scoring::FirstToken => "Answer with one of the options.",
        Scoring::Letter => "Answer with the letter of one option.",
    });
    let text = if chat {
        format!("{}{cue}", codec.chat_prompt(&question)?)
    } else {
        format!("{question}\n{cue}")
    };
    let prompt_ids = codec.encode(&text)?;
    let state_only = codec.encode(state)?.len();
    Ok(DecisionPlan {
        schema_tokens: u32::try_from(prompt_ids.len().saturating_sub(state_only))
            .unwrap_or(u32::MAX),
        text,
        prompt_ids,
        question: ask.question.clone(),
        options: ask.options.clone(),
        scoring,
        labels,
    })
}

/// The token each answer begins with after `cue` (with `gap` between);
/// `None` where the answer's tokens do not keep the cue's as their prefix.
fn first_tokens<'a>(
    codec: &TextCodec,
    cue: &str,
    gap: &str,
    answers: impl Iterator<Item = &'a str>,
) -> anyhow::Result<Vec<Option<u32>>> {
    let base = codec.encode(cue)?;
    answers
        .map(|answer| {
            let with = codec.encode(&format!("{cue}{gap}{answer}"))?;
            Ok(with
                .strip_prefix(base.as_slice())
                .and_then(|rest| rest.first().copied()))
        })
        .collect()
}

/// Every answer has a first token, and no two share one.
fn distinct(firsts: &[Option<u32>]) -> bool {
    firsts
        .iter()
        .enumerate()
        .all(|(i, t)| t.is_some() && !firsts[..i].contains(t))
}

/// Up to `wanted` letters that each encode as exactly one token after
/// `cue` (with `gap` between), with their tokens, all distinct.
fn single_token_letters(
    codec: &TextCodec,
    cue: &str,
    gap: &str,
    wanted: usize,
) -> anyhow::Result<Vec<(Option<char>, u32)>> {
    let base = codec.encode(cue)?;
    let mut labels: Vec<(Option<char>, u32)> = Vec::with_capacity(wanted);
    for letter in LETTERS.chars() {
        if labels.len() == wanted {
            break;
        }
        let with = codec.encode(&format!("{cue}{gap}{letter}"))?;
        if with.len() == base.len() + 1 && with.starts_with(&base) {
            let token = with[base.len()];
            if !labels.iter().any(|(_, t)| *t == token) {
                labels.push((Some(letter), token));
            }
        }
    }
    Ok(labels)
}

impl DecisionPlan {
    /// Each option's probability from the logits at the prompt's last
    /// position: a softmax over the options' letters alone.
    pub fn score(&self, logits: &[f32]) -> anyhow::Result<Vec<f64>> {
        let picked: Vec<f64> = self
            .labels
            .iter()
            .map(|(_, token)| {
                logits
                    .get(*token as usize)
                    .map(|l| f64::from(*l))
                    .filter(|l| l.is_finite())
            })
            .collect::<Option<_>>()
            .ok_or_else(|| anyhow::anyhow!("an option's letter is outside the model's logits"))?;
        let max = picked.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let exp: Vec<f64> = picked.iter().map(|l| (l - max).exp()).collect();
        let sum: f64 = exp.iter().sum();
        Ok(exp.iter().map(|e| e / sum).collect())
    }

    /// The chosen option (the most probable; the first of equals).
    pub fn chosen(probabilities: &[f64]) -> usize {
        let mut best = 0;
        for (i, p) in probabilities.iter().enumerate() {
            if *p > probabilities[best] {
                best = i;
            }
        }
        best
    }

    /// The answer as the requester reads it.
    pub fn to_json(&self, probabilities: &[f64]) -> serde_json::Value {
        let chosen = Self::chosen(probabilities);
        json!({
            "question": self.question,
            "options": self.options.iter().zip(&self.labels).zip(probabilities).map(|((option, (letter, _)), p)| {
                let mut scored = json!({ "option": option, "probability": p });
                if let (Some(letter), serde_json::Value::Object(map)) = (letter, &mut scored) {
                    map.insert("label".into(), json!(letter.to_string()));
                }
                scored
            }).collect::<Vec<_>>(),
            "scored_by": self.scoring.as_str(),
            "chosen": self.options.get(chosen),
            "schema_tokens": self.schema_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_are_a_softmax_over_the_letters_and_the_first_of_equals_wins() {
        let plan = DecisionPlan {
            text: String::new(),
            prompt_ids: Vec::new(),
            question: "q".into(),
            options: vec!["yes".into(), "no".into(), "maybe".into()],
            scoring: Scoring::Letter,
            labels: vec![(Some('A'), 1), (Some('B'), 3), (Some('C'), 4)],
            schema_tokens: 0,
        };
        let logits = [9.0, 2.0, 9.0, 1.0, 2.0];
        let p = plan.score(&logits).unwrap();
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(p[0] > p[1] && (p[0] - p[2]).abs() < 1e-12);
        assert_eq!(DecisionPlan::chosen(&p), 0);
        assert!(
            plan.score(&logits[..4]).is_err(),
            "a letter past the vocabulary"
        );
        let answer = plan.to_json(&p);
        assert_eq!(answer["chosen"], "yes");
        assert_eq!(answer["options"][1]["label"], "B");
    }
}
