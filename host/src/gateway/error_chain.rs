//! An error's chain of causes: hyper's and hyper-util's own messages
//! ("client error (Connect)", "error writing a body to connection") say
//! what failed, only their causes say why.

use std::error::Error;

/// `error`, then each of its causes in turn.
pub fn causes<'e>(
    error: &'e (dyn Error + 'static),
) -> impl Iterator<Item = &'e (dyn Error + 'static)> {
    std::iter::successors(Some(error), |&e| e.source())
}

/// `error` and every cause, joined with ": ".
pub fn describe(error: &(dyn Error + 'static)) -> String {
    causes(error)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that names its cause as its source.
    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("writing failed")
        }
    }

    impl Error for Outer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn every_cause_is_named_outermost_first() {
        let outer = Outer(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "took too long",
        ));
        assert_eq!(causes(&outer).count(), 2);
        assert_eq!(describe(&outer), "writing failed: took too long");
    }
}
