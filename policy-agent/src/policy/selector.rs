//! Label selectors (`metav1.LabelSelector`).
use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::cluster::Labels;

/// One `matchExpressions` element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Requirement {
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
    Exists(String),
    DoesNotExist(String),
}

impl Requirement {
    /// "operator represents a key's relationship to a set of values. Valid
    /// operators are In, NotIn, Exists and DoesNotExist." NotIn holds when
    /// the key is missing (apimachinery `Requirement.Matches`: "NotIn: if
    /// !ls.Has(key) return true").
    pub fn matches(&self, labels: &Labels) -> bool {
        match self {
            Self::In(k, values) => labels.get(k).is_some_and(|v| values.contains(v)),
            Self::NotIn(k, values) => labels.get(k).is_none_or(|v| !values.contains(v)),
            Self::Exists(k) => labels.contains_key(k),
            Self::DoesNotExist(k) => !labels.contains_key(k),
        }
    }
}

/// A validated label selector.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector {
    /// `matchLabels`: "each {key,value} ... is equivalent to an element of
    /// matchExpressions, whose key field is "key", the operator is "In", and
    /// the values array contains only "value"."
    pub match_labels: Vec<(String, String)>,
    pub match_expressions: Vec<Requirement>,
}

impl Selector {
    /// `{}`: "An empty label selector matches all objects."
    pub fn everything() -> Self {
        Self::default()
    }

    /// "The requirements are ANDed": matchLabels and matchExpressions alike.
    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| r.matches(labels))
    }

    /// Validates `sel`. The error names the field below the selector
    /// (`matchExpressions[1].values`) and what is wrong with it.
    pub fn parse(sel: &LabelSelector) -> Result<Self, (String, String)> {
        let mut out = Self::default();
        for (k, v) in sel.match_labels.iter().flatten() {
            if k.is_empty() {
                return Err(("matchLabels".into(), "a label key must not be empty".into()));
            }
            out.match_labels.push((k.clone(), v.clone()));
        }
        for (i, expr) in sel.match_expressions.iter().flatten().enumerate() {
            let field = format!("matchExpressions[{i}]");
            if expr.key.is_empty() {
                return Err((
                    format!("{field}.key"),
                    "a label key must not be empty".into(),
                ));
            }
            let values: BTreeSet<String> = expr.values.iter().flatten().cloned().collect();
            let has_values = expr.values.as_ref().is_some_and(|v| !v.is_empty());
            let key = expr.key.clone();
            // "If the operator is In or NotIn, the values array must be
            // non-empty. If the operator is Exists or DoesNotExist, the
            // values array must be empty."
            let req = match expr.operator.as_str() {
                "In" | "NotIn" if !has_values => {
                    return Err((
                        format!("{field}.values"),
                        format!("operator {} needs at least one value", expr.operator),
                    ));
                }
                "Exists" | "DoesNotExist" if has_values => {
                    return Err((
                        format!("{field}.values"),
                        format!("operator {} takes no values", expr.operator),
                    ));
                }
                "In" => Requirement::In(key, values),
                "NotIn" => Requirement::NotIn(key, values),
                "Exists" => Requirement::Exists(key),
                "DoesNotExist" => Requirement::DoesNotExist(key),
                other => {
                    return Err((
                        format!("{field}.operator"),
                        format!("{other:?} is not In, NotIn, Exists or DoesNotExist"),
                    ));
                }
            };
            out.match_expressions.push(req);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    use super::*;

    fn labels(kv: &[(&str, &str)]) -> Labels {
        kv.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: Option<&[&str]>) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: values.map(|v| v.iter().map(|s| (*s).to_owned()).collect()),
        }
    }

    fn sel(exprs: Vec<LabelSelectorRequirement>) -> LabelSelector {
        LabelSelector {
            match_expressions: Some(exprs),
            match_labels: None,
        }
    }

    /// (name, operator, values, labels, matches)
    type Case<'a> = (
        &'a str,
        &'a str,
        Option<&'a [&'a str]>,
        &'a [(&'a str, &'a str)],
        bool,
    );

    #[test]
    fn operators() {
        let cases: &[Case] = &[
            (
                "in matches a listed value",
                "In",
                Some(&["a", "b"]),
                &[("k", "b")],
                true,
            ),
            (
                "in rejects other values",
                "In",
                Some(&["a"]),
                &[("k", "c")],
                false,
            ),
            ("in rejects a missing key", "In", Some(&["a"]), &[], false),
            (
                "notin rejects a listed value",
                "NotIn",
                Some(&["a"]),
                &[("k", "a")],
                false,
            ),
            (
                "notin accepts other values",
                "NotIn",
                Some(&["a"]),
                &[("k", "b")],
                true,
            ),
            (
                "notin on a missing key is true",
                "NotIn",
                Some(&["a"]),
                &[],
                true,
            ),
            ("exists", "Exists", None, &[("k", "")], true),
            (
                "exists rejects a missing key",
                "Exists",
                None,
                &[("j", "x")],
                false,
            ),
            (
                "doesnotexist",
                "DoesNotExist",
                Some(&[]),
                &[("j", "x")],
                true,
            ),
            (
                "doesnotexist rejects a present key",
                "DoesNotExist",
                None,
                &[("k", "x")],
                false,
            ),
        ];
        for (name, op, values, l, want) in cases {
            let s = Selector::parse(&sel(vec![expr("k", op, *values)])).unwrap();
            assert_eq!(s.matches(&labels(l)), *want, "{name}");
        }
    }

    #[test]
    fn match_labels_and_expressions_are_anded() {
        let s = Selector::parse(&LabelSelector {
            match_labels: Some([("app".to_owned(), "web".to_owned())].into()),
            match_expressions: Some(vec![expr("tier", "In", Some(&["fe"]))]),
        })
        .unwrap();
        assert!(s.matches(&labels(&[("app", "web"), ("tier", "fe")])));
        assert!(!s.matches(&labels(&[("app", "web")])));
        assert!(!s.matches(&labels(&[("tier", "fe")])));
        assert!(
            Selector::parse(&LabelSelector::default())
                .unwrap()
                .matches(&labels(&[]))
        );
    }

    #[test]
    fn malformed_requirements_are_rejected() {
        for (op, values, field) in [
            ("In", None, "matchExpressions[0].values"),
            ("NotIn", Some(&[][..]), "matchExpressions[0].values"),
            ("Exists", Some(&["x"][..]), "matchExpressions[0].values"),
            (
                "DoesNotExist",
                Some(&["x"][..]),
                "matchExpressions[0].values",
            ),
            ("Equals", Some(&["x"][..]), "matchExpressions[0].operator"),
        ] {
            let err = Selector::parse(&sel(vec![expr("k", op, values)])).unwrap_err();
            assert_eq!(err.0, field, "{op}");
        }
    }
}
