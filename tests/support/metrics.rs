//! The one reader of a Prometheus text scrape (`/metrics`) for every test.
//!
//! A sample is matched by its whole series, name and labels exactly as the node prints
//! them (`graviton_uploads_total{outcome="ok"}`), never by a prefix of the line: a prefix
//! match lets `… 1` also match `10` to `19`, and `graviton_download_bytes_total` also
//! match `graviton_download_bytes_total_x`. Comment lines (`# HELP`, `# TYPE`, `# EOF`)
//! are skipped; a series's name is its key up to the end of its label set.

/// Every sample of a scrape: (series, value), in scrape order.
pub fn samples(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| {
            // The series ends at the label set's closing brace (label values may hold
            // spaces), else at the first space.
            let end = match (line.find('{'), line.find(' ')) {
                (Some(brace), Some(space)) if brace < space => line.rfind('}')? + 1,
                (_, Some(space)) => space,
                _ => return None,
            };
            let (series, rest) = line.split_at(end);
            let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
            Some((series.to_string(), value))
        })
        .collect()
}

/// The value of the sample named exactly `series`, `None` when the scrape has none.
/// Panics when the scrape has it twice (a scrape names each series once).
pub fn value(text: &str, series: &str) -> Option<f64> {
    let mut found = samples(text)
        .into_iter()
        .filter(|(name, _)| name == series)
        .map(|(_, value)| value);
    let first = found.next();
    assert!(
        found.next().is_none(),
        "the series {series} appears twice in the scrape:\n{text}"
    );
    first
}

/// The value of `series` as a whole number (counters, byte gauges); `None` when absent.
pub fn count(text: &str, series: &str) -> Option<u64> {
    value(text, series).map(|v| {
        assert!(
            v >= 0.0 && v.fract() == 0.0,
            "{series} is {v}, not a whole number"
        );
        v as u64
    })
}

/// The value of `series`, 0 while the series does not exist yet (a counter no event has
/// touched).
pub fn count_or_zero(text: &str, series: &str) -> u64 {
    count(text, series).unwrap_or(0)
}

/// The value of `series`; panics with the scrape when it is absent.
pub fn require(text: &str, series: &str) -> u64 {
    count(text, series).unwrap_or_else(|| panic!("no sample {series} in the scrape:\n{text}"))
}

/// Whether the metric family `name` is registered (its `# TYPE` line is in the scrape),
/// whether or not any sample of it exists yet.
pub fn registered(text: &str, name: &str) -> bool {
    text.lines().any(|line| {
        line.strip_prefix("# TYPE ")
            .and_then(|rest| rest.split_whitespace().next())
            .is_some_and(|family| {
                family == name
                    || name
                        .strip_suffix("_total")
                        .is_some_and(|stem| family == stem)
            })
    })
}
