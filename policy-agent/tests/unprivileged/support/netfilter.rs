//! An evaluator of the `ipset restore` and `iptables-restore` text the
//! iptables renderer writes (`Ruleset::render_text`), written against the
//! text alone, as netfilter would read it: sets with their `hash:ip` /
//! `hash:net` (`nomatch`) semantics, chains, jumps, RETURN, DROP, MARK
//! `--set-xmark` and the matches the renderer uses. Anything else in the
//! text is refused, so a new kind of rule cannot slip past the check.
//! Golden files pin the text; this says what the text does: what crosses
//! FORWARD ([`Netfilter::forward`]) and what a pod sends to the node
//! (INPUT, [`Netfilter::input`]).
use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;
use policy_common::proto;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SetKind {
    Ip,
    Net,
}

#[derive(Clone, Debug)]
struct Set {
    kind: SetKind,
    v6: bool,
    /// (prefix, nomatch)
    entries: Vec<(IpNet, bool)>,
}

impl Set {
    fn contains(&self, a: IpAddr) -> bool {
        if a.is_ipv6() != self.v6 {
            return false;
        }
        match self.kind {
            SetKind::Ip => self.entries.iter().any(|(n, _)| n.addr() == a),
            // The most specific entry containing the address decides; a
            // `nomatch` entry makes it a non-member.
            SetKind::Net => self
                .entries
                .iter()
                .filter(|(n, _)| n.contains(&a))
                .max_by_key(|(n, _)| n.prefix_len())
                .is_some_and(|(_, nomatch)| !nomatch),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Match {
    CtState(Vec<String>),
    In(String),
    Out(String),
    Src(IpNet),
    Dst(IpNet),
    Set {
        name: String,
        src: bool,
    },
    Proto(u8),
    Dport(u16, u16),
    Mark {
        value: u32,
        mask: u32,
    },
    /// The flow's connmark (a new packet's flow has none yet).
    ConnMark {
        value: u32,
        mask: u32,
        negated: bool,
    },
    /// `--ctdir`: a new packet is in the original direction.
    CtDir(String),
    /// `-m addrtype ! --src-type LOCAL`: the evaluator's packets come from
    /// pods and the world, never from one of the node's own addresses.
    SrcNotLocal,
    /// `! <match>` (`-i`, `-o`, `-s`, `-d`).
    Not(Box<Match>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    Return,
    Drop,
    Accept,
    Jump(String),
    SetXmark {
        value: u32,
        mask: u32,
    },
    /// CONNMARK: the flow's mark (nothing a verdict depends on here).
    ConnMarkSet,
}

#[derive(Clone, Debug)]
struct Rule {
    matches: Vec<Match>,
    target: Target,
}

/// One family's filter table.
#[derive(Clone, Debug, Default)]
struct Table {
    chains: BTreeMap<String, Vec<Rule>>,
}

/// A packet crossing the node's FORWARD hook, as the first of its flow
/// (or INPUT: then `out_if` is empty, as netfilter has no output
/// interface there).
#[derive(Clone, Debug)]
pub struct Packet {
    pub in_if: String,
    pub out_if: String,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    pub dport: u16,
}

#[derive(Clone, Debug, Default)]
pub struct Netfilter {
    sets: BTreeMap<String, Set>,
    v4: Table,
    v6: Table,
}

fn hex(s: &str) -> u32 {
    u32::from_str_radix(s.trim_start_matches("0x"), 16)
        .unwrap_or_else(|_| panic!("not a hex number: {s}"))
}

fn mark_pair(s: &str) -> (u32, u32) {
    let (v, m) = s.split_once('/').unwrap_or((s, "0xffffffff"));
    (hex(v), hex(m))
}

fn net(s: &str) -> IpNet {
    s.parse::<IpNet>()
        .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
        .unwrap_or_else(|_| panic!("not an address or prefix: {s}"))
}

/// Splits a rule into words; a double-quoted string (a comment) is one
/// word.
pub fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            c if c.is_whitespace() && !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn protocol(p: &str) -> u8 {
    match p {
        "tcp" => proto::TCP,
        "udp" => proto::UDP,
        "sctp" => proto::SCTP,
        "icmp" => proto::ICMP,
        "ipv6-icmp" | "icmpv6" => proto::ICMPV6,
        other => other
            .parse()
            .unwrap_or_else(|_| panic!("unknown protocol {other}")),
    }
}

fn parse_rule(w: &[String]) -> Rule {
    let mut matches = Vec::new();
    let mut target = None;
    let mut i = 0;
    // A `!` negates the address or interface match after it.
    let mut negate = false;
    let arg = |i: usize| -> &str {
        w.get(i)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("missing argument in {w:?}"))
    };
    while i < w.len() {
        let word = w[i].as_str();
        if negate && !matches!(word, "-i" | "-o" | "-s" | "-d") {
            panic!("`!` before {word} in {w:?}");
        }
        let before = matches.len();
        match word {
            "!" => {
                assert!(!negate, "`! !` in {w:?}");
                negate = true;
                i += 1;
                continue;
            }
            "-m" => match arg(i + 1) {
                "conntrack" => {
                    match arg(i + 2) {
                        "--ctstate" => matches.push(Match::CtState(
                            arg(i + 3).split(',').map(str::to_owned).collect(),
                        )),
                        "--ctdir" => matches.push(Match::CtDir(arg(i + 3).to_owned())),
                        other => panic!("conntrack {other} in {w:?}"),
                    }
                    i += 4;
                }
                "connmark" => {
                    let negated = arg(i + 2) == "!";
                    let at = i + 2 + usize::from(negated);
                    assert_eq!(arg(at), "--mark", "{w:?}");
                    let (value, mask) = mark_pair(arg(at + 1));
                    matches.push(Match::ConnMark {
                        value,
                        mask,
                        negated,
                    });
                    i = at + 2;
                }
                "comment" => {
                    assert_eq!(arg(i + 2), "--comment", "{w:?}");
                    i += 4;
                }
                "set" => {
                    assert_eq!(arg(i + 2), "--match-set", "{w:?}");
                    let src = match arg(i + 4) {
                        "src" => true,
                        "dst" => false,
                        other => panic!("set direction {other} in {w:?}"),
                    };
                    matches.push(Match::Set {
                        name: arg(i + 3).to_owned(),
                        src,
                    });
                    i += 5;
                }
                "mark" => {
                    assert_eq!(arg(i + 2), "--mark", "{w:?}");
                    let (value, mask) = mark_pair(arg(i + 3));
                    matches.push(Match::Mark { value, mask });
                    i += 4;
                }
                "addrtype" => {
                    assert_eq!(
                        (arg(i + 2), arg(i + 3), arg(i + 4)),
                        ("!", "--src-type", "LOCAL"),
                        "{w:?}"
                    );
                    matches.push(Match::SrcNotLocal);
                    i += 5;
                }
                other => panic!("unknown match module {other} in {w:?}"),
            },
            "-i" => {
                matches.push(Match::In(arg(i + 1).to_owned()));
                i += 2;
            }
            "-o" => {
                matches.push(Match::Out(arg(i + 1).to_owned()));
                i += 2;
            }
            "-s" => {
                matches.push(Match::Src(net(arg(i + 1))));
                i += 2;
            }
            "-d" => {
                matches.push(Match::Dst(net(arg(i + 1))));
                i += 2;
            }
            "-p" => {
                matches.push(Match::Proto(protocol(arg(i + 1))));
                i += 2;
            }
            "--dport" => {
                let p = arg(i + 1);
                let (a, b) = p.split_once(':').unwrap_or((p, p));
                let port = |s: &str| s.parse().unwrap_or_else(|_| panic!("port {s} in {w:?}"));
                assert!(
                    matches
                        .iter()
                        .any(|m| matches!(m, Match::Proto(p) if proto::has_ports(*p))),
                    "--dport without a port protocol in {w:?}"
                );
                matches.push(Match::Dport(port(a), port(b)));
                i += 2;
            }
            "-j" => {
                target = Some(match arg(i + 1) {
                    "RETURN" => Target::Return,
                    "DROP" => Target::Drop,
                    "ACCEPT" => Target::Accept,
                    "MARK" => {
                        assert_eq!(arg(i + 2), "--set-xmark", "{w:?}");
                        let (value, mask) = mark_pair(arg(i + 3));
                        i += 2;
                        Target::SetXmark { value, mask }
                    }
                    "CONNMARK" => {
                        assert_eq!(arg(i + 2), "--set-xmark", "{w:?}");
                        i += 2;
                        Target::ConnMarkSet
                    }
                    chain if chain.starts_with("pa-agent:") => Target::Jump(chain.to_owned()),
                    other => panic!("unknown target {other} in {w:?}"),
                });
                i += 2;
            }
            other => panic!("unknown rule word {other} in {w:?}"),
        }
        if negate {
            assert_eq!(matches.len(), before + 1, "{w:?}");
            let m = matches.pop().expect("the negated match");
            matches.push(Match::Not(Box::new(m)));
            negate = false;
        }
    }
    assert!(!negate, "a trailing `!` in {w:?}");
    Rule {
        matches,
        target: target.unwrap_or_else(|| panic!("rule without a target: {w:?}")),
    }
}

impl Netfilter {
    /// Reads the text of `Ruleset::render_text` (panics on anything it
    /// does not know).
    pub fn parse(text: &str) -> Self {
        let mut nf = Self::default();
        #[derive(PartialEq)]
        enum Section {
            None,
            Ipset,
            Ip(bool),
        }
        let mut section = Section::None;
        for raw in text.lines() {
            let line = raw.trim();
            match line {
                "# ipset restore" => {
                    section = Section::Ipset;
                    continue;
                }
                "# iptables-restore --noflush" => {
                    section = Section::Ip(false);
                    continue;
                }
                "# ip6tables-restore --noflush" => {
                    section = Section::Ip(true);
                    continue;
                }
                "" | "*filter" | "COMMIT" => continue,
                _ => {}
            }
            match section {
                Section::None => panic!("text before a section: {line}"),
                Section::Ipset => nf.ipset_line(line),
                Section::Ip(v6) => {
                    let table = if v6 { &mut nf.v6 } else { &mut nf.v4 };
                    // A trailing "# ..." is a note for the reader.
                    let line = line.split(" #").next().unwrap_or(line).trim();
                    let w = words(line);
                    match w.first().map(String::as_str) {
                        Some(decl) if decl.starts_with(':') => {
                            table
                                .chains
                                .entry(decl.trim_start_matches(':').to_owned())
                                .or_default();
                        }
                        Some("-A") => {
                            let rule = parse_rule(&w[2..]);
                            table
                                .chains
                                .get_mut(&w[1])
                                .unwrap_or_else(|| panic!("rule for an undeclared chain: {line}"))
                                .push(rule);
                        }
                        Some("-I") => {
                            assert!(
                                matches!(w[1].as_str(), "FORWARD" | "INPUT" | "OUTPUT"),
                                "{line}"
                            );
                            let at: usize = w[2].parse().expect("insert position");
                            let rule = parse_rule(&w[3..]);
                            table
                                .chains
                                .entry(w[1].clone())
                                .or_default()
                                .insert(at - 1, rule);
                        }
                        _ => panic!("unknown iptables line: {line}"),
                    }
                }
            }
        }
        nf
    }

    fn ipset_line(&mut self, line: &str) {
        let w = words(line);
        match w.first().map(String::as_str) {
            Some("create") => {
                let kind = match w[2].as_str() {
                    "hash:ip" => SetKind::Ip,
                    "hash:net" => SetKind::Net,
                    other => panic!("unknown set type {other}"),
                };
                assert_eq!(w[3], "family", "{line}");
                let v6 = match w[4].as_str() {
                    "inet" => false,
                    "inet6" => true,
                    other => panic!("unknown set family {other}"),
                };
                assert!(w.iter().any(|x| x == "-exist"), "{line}");
                self.sets.entry(w[1].clone()).or_insert(Set {
                    kind,
                    v6,
                    entries: Vec::new(),
                });
            }
            Some("flush") => self.set_mut(&w[1]).entries.clear(),
            Some("add") => {
                let nomatch = match w.get(3).map(String::as_str) {
                    None => false,
                    Some("nomatch") => true,
                    Some(other) => panic!("unknown add option {other}"),
                };
                let entry = net(&w[2]);
                let set = self.set_mut(&w[1]);
                assert_eq!(entry.addr().is_ipv6(), set.v6, "{line}");
                if set.kind == SetKind::Ip {
                    assert!(
                        !nomatch && entry.prefix_len() == entry.max_prefix_len(),
                        "{line}"
                    );
                }
                set.entries.push((entry, nomatch));
            }
            Some("swap") => {
                let a = self.set_mut(&w[1]).clone();
                let b = self.set_mut(&w[2]).clone();
                assert_eq!(
                    (a.kind, a.v6),
                    (b.kind, b.v6),
                    "swap of unlike sets: {line}"
                );
                self.sets.insert(w[1].clone(), b);
                self.sets.insert(w[2].clone(), a);
            }
            Some("destroy") => {
                assert!(
                    self.sets.remove(&w[1]).is_some(),
                    "destroy of a missing set: {line}"
                );
            }
            _ => panic!("unknown ipset line: {line}"),
        }
    }

    fn set_mut(&mut self, name: &str) -> &mut Set {
        self.sets
            .get_mut(name)
            .unwrap_or_else(|| panic!("no set {name}"))
    }

    fn matches(&self, m: &Match, p: &Packet, mark: u32) -> bool {
        match m {
            // The first packet of a flow is NEW.
            Match::CtState(states) => states.iter().any(|s| s == "NEW"),
            Match::In(i) => *i == p.in_if,
            Match::Out(o) => *o == p.out_if,
            Match::Src(n) => n.contains(&p.src),
            Match::Dst(n) => n.contains(&p.dst),
            Match::Set { name, src } => self
                .sets
                .get(name)
                .unwrap_or_else(|| panic!("a rule uses the missing set {name}"))
                .contains(if *src { p.src } else { p.dst }),
            Match::Proto(pr) => *pr == p.protocol,
            Match::Dport(a, b) => (*a..=*b).contains(&p.dport),
            Match::Mark { value, mask } => mark & mask == *value,
            // A new packet's flow has connmark 0.
            Match::ConnMark {
                value,
                mask: _,
                negated,
            } => (*value == 0) != *negated,
            Match::CtDir(d) => d == "ORIGINAL",
            Match::SrcNotLocal => true,
            Match::Not(m) => !self.matches(m, p, mark),
        }
    }

    /// Runs `chain`; Some(accepted) on a terminal verdict, None when it
    /// returns (or falls off its end).
    fn run(
        &self,
        table: &Table,
        chain: &str,
        p: &Packet,
        mark: &mut u32,
        depth: u32,
    ) -> Option<bool> {
        assert!(depth < 16, "jump loop at {chain}");
        let rules = table
            .chains
            .get(chain)
            .unwrap_or_else(|| panic!("a jump to the missing chain {chain}"));
        for rule in rules {
            if !rule.matches.iter().all(|m| self.matches(m, p, *mark)) {
                continue;
            }
            match &rule.target {
                Target::Return => return None,
                Target::Drop => return Some(false),
                Target::Accept => return Some(true),
                Target::SetXmark { value, mask } => *mark = (*mark & !mask) ^ value,
                Target::ConnMarkSet => {}
                Target::Jump(c) => {
                    if let Some(v) = self.run(table, c, p, mark, depth + 1) {
                        return Some(v);
                    }
                }
            }
        }
        None
    }

    /// Whether the FORWARD hook lets the packet through (its policy is
    /// ACCEPT: only what the rules drop is dropped).
    pub fn forward(&self, p: &Packet) -> bool {
        self.hook("FORWARD", p)
    }

    /// Whether the INPUT hook lets the packet (to one of the node's own
    /// addresses) in.
    pub fn input(&self, p: &Packet) -> bool {
        assert!(p.out_if.is_empty(), "INPUT has no output interface");
        self.hook("INPUT", p)
    }

    fn hook(&self, builtin: &str, p: &Packet) -> bool {
        let table = if p.src.is_ipv6() { &self.v6 } else { &self.v4 };
        let mut mark = 0;
        if !table.chains.contains_key(builtin) {
            return true;
        }
        self.run(table, builtin, p, &mut mark, 0).unwrap_or(true)
    }
}
