//! MTP beside other decoding sequences (issue 48): a sequence with a draft
//! head either keeps drafting (`MtpBeside::Draft`) or takes passes without a
//! draft while others decode and drafts again once alone
//! (`MtpBeside::Pause`). Either way, on `cpu:exact` each of 1, 2 and 4
//! concurrent greedy streams generates the tokens the model gives it alone
//! without the head; and a sequence decoded without drafts (a constrained
//! request) keeps the head's rows, so a later speculative turn continues it.

mod common;

use std::ops::ControlFlow;
use std::sync::Barrier;

use slotstream::generate::{Drafter, Engine, GenerateOutput, MtpBeside, TokenConstraint};
use slotstream::model::LoadOptions;

const NAME: &str = "qwen4_exp_tiny";

fn engine(mtp: bool) -> Engine {
    let opts = LoadOptions { mtp, ..Default::default() };
    Engine::load(&common::fixture(NAME), Box::new(slotstream_cpu::CpuBackend::exact()), &opts)
        .unwrap_or_else(|e| panic!("loading {NAME}: {e:#}"))
}

/// Four different prompts: the golden short prompt and three of its suffixes.
fn prompts() -> Vec<Vec<u32>> {
    let base = common::case(NAME, "short").prompt_ids;
    (0..4).map(|i| base[i..].to_vec()).collect()
}

/// Drafts right at three of every four generated positions (from each
/// prompt's answer alone), so drafting goes on (the fixture's own head is
/// random: it would pause for low acceptance) and both verdicts occur.
fn drafter(answers: Vec<(Vec<u32>, Vec<u32>)>) -> Drafter {
    Box::new(move |history: &[u32]| {
        let found = answers.iter().find(|(p, a)| history.starts_with(p) && a.get(..history.len() - p.len()) == Some(&history[p.len()..]));
        let Some((p, a)) = found else { return 0 };
        let i = history.len() - p.len();
        let right = a.get(i).copied().unwrap_or(0);
        if i % 4 < 3 { right } else { (right + 1) % 500 }
    })
}

/// Each job's greedy generation on a thread of its own; the threads feed
/// their prompts but the last token, then start decoding together.
fn concurrently(e: &Engine, jobs: &[(Vec<u32>, usize)]) -> Vec<GenerateOutput> {
    let ready = Barrier::new(jobs.len());
    std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(p, tokens)| {
                let ready = &ready;
                scope.spawn(move || {
                    let mut state = e.new_state().expect("a state");
                    assert!(e.prefill_until(p, p.len() - 1, &mut state, || false).expect("the prompt"));
                    ready.wait();
                    let out = e.generate_from(&mut state, &common::greedy_request(p, *tokens), |_| ControlFlow::Continue(()));
                    out.expect("a generation")
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a generation thread")).collect()
    })
}

#[test]
fn concurrent_streams_with_mtp_generate_their_text_without_it() {
    let prompts = prompts();
    // The first stream outlasts the others, so that it decodes alone at the end.
    let tokens = |i: usize| if i == 0 { 40 } else { 10 };
    let plain = engine(false);
    let alone: Vec<Vec<u32>> = (0..4).map(|i| concurrently(&plain, &[(prompts[i].clone(), tokens(i))]).remove(0).generated_ids).collect();
    let mut e = engine(true);
    assert_eq!(e.mtp_beside_others, MtpBeside::Draft, "the default");
    let opts = LoadOptions { mtp: true, mtp_pause_beside_others: true, ..Default::default() };
    assert_eq!(MtpBeside::from_options(&opts), MtpBeside::Pause);
    e.set_parallel(4).expect("4 sequences");
    e.drafter = Some(drafter(prompts.iter().cloned().zip(alone.iter().cloned()).collect()));
    for policy in [MtpBeside::Draft, MtpBeside::Pause] {
        e.mtp_beside_others = policy;
        for streams in [1, 2, 4] {
            let jobs: Vec<(Vec<u32>, usize)> = (0..streams).map(|i| (prompts[i].clone(), tokens(i))).collect();
            for (i, out) in concurrently(&e, &jobs).iter().enumerate() {
                let what = format!("{policy:?}, stream {i} of {streams}");
                assert_eq!(out.generated_ids, alone[i], "{what}: differs from its tokens alone without MTP");
                let mtp = out.stats.mtp.unwrap_or_else(|| panic!("{what}: no MTP stats"));
                assert!(!mtp.paused, "{what}: {mtp:?}");
                if i > 0 {
                    continue;
                }
                if policy == MtpBeside::Pause && streams > 1 {
                    // Paused while the others decoded, drafting again alone.
                    assert!(mtp.passes_beside_others > 0, "{what}: never paused beside the others: {mtp:?}");
                    assert!(mtp.drafted >= 4 && mtp.accepted > 0, "{what}: drafting did not resume once alone: {mtp:?}");
                } else {
                    assert_eq!(mtp.passes_beside_others, 0, "{what}: {mtp:?}");
                    assert!(mtp.drafted >= 8 && mtp.accepted > 0, "{what}: {mtp:?}");
                }
            }
        }
    }
}

/// Lets every token through.
struct AnyToken;

impl TokenConstraint for AnyToken {
    fn mask(&mut self, _logits: &mut [f32]) -> anyhow::Result<bool> {
        Ok(true)
    }
    fn commit(&mut self, _token: u32) -> anyhow::Result<bool> {
        Ok(false)
    }
}

/// A constrained turn decodes one token per pass, without drafts; the next
/// turn on the same state (a chat's, from the prefix cache) drafts again.
#[test]
fn a_turn_without_drafts_keeps_the_heads_rows() {
    let prompt = common::case(NAME, "short").prompt_ids;
    let plain = engine(false);
    let whole = plain.generate(&common::greedy_request(&prompt, 90), |_| ControlFlow::Continue(())).expect("plain greedy");
    let e = engine(true);
    let mut state = e.new_state().expect("a state");
    // Longer than the head's backlog, so that it catches up along the way too.
    let first = e
        .generate_constrained(&mut state, &common::greedy_request(&prompt, 80), Some(&mut AnyToken), |_| ControlFlow::Continue(()))
        .expect("a constrained turn");
    assert_eq!(first.generated_ids, whole.generated_ids[..80], "the constrained turn");
    assert!(first.stats.mtp.is_none(), "a constrained turn drafts nothing");
    let mut next = prompt.clone();
    next.extend(&first.generated_ids);
    let second = e.generate_from(&mut state, &common::greedy_request(&next, 10), |_| ControlFlow::Continue(())).expect("the next turn");
    assert_eq!(second.generated_ids, whole.generated_ids[80..], "the next turn");
    let mtp = second.stats.mtp.expect("MTP stats");
    assert!(mtp.drafted > 0, "{mtp:?}");
}
