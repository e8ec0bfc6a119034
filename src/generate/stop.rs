//! Stop strings: text that could be the start of one is held back, and a
//! match ends generation before the stop string is emitted.

/// Holds back text that could be the start of a stop string, and finds stops.
pub(super) struct StopMatcher<'a> {
    stops: &'a [String],
    pending: String,
}

impl<'a> StopMatcher<'a> {
    pub fn new(stops: &'a [String]) -> Self {
        StopMatcher { stops, pending: String::new() }
    }

    /// Adds text; returns what is safe to emit and whether a stop string matched.
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        if let Some(at) = self.stops.iter().filter(|s| !s.is_empty()).filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // The longest suffix of `pending` that is a prefix of some stop string.
        let mut hold = 0;
        for s in self.stops {
            for (i, _) in self.pending.char_indices() {
                let tail = &self.pending[i..];
                if s.starts_with(tail) {
                    hold = hold.max(tail.len());
                    break;
                }
            }
        }
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_held_back_and_cut() {
        let stops = vec!["</end>".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("hello <"), ("hello ".to_string(), false));
        assert_eq!(m.push("/en"), (String::new(), false));
        assert_eq!(m.push("d> more"), (String::new(), true));
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("a </e"), ("a ".to_string(), false));
        assert_eq!(m.push("x"), ("</ex".to_string(), false));
        assert_eq!(m.finish(), "");
    }
}
