//! kube-proxy's chain names: `base32(sha256(...))` truncated, exactly as
//! upstream computes them (`portProtoHash`, `servicePortEndpointChainName`
//! in pkg/proxy/iptables; `hashAndTruncate` in pkg/proxy/nftables).

/// SHA-256 (FIPS 180-4); small inputs only, so no streaming.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(h) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

/// RFC 4648 base32, standard alphabet (padding left out: callers
/// truncate well before it).
pub fn base32(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(data.len().div_ceil(5) * 8);
    let mut buffer: u64 = 0;
    let mut bits = 0;
    for byte in data {
        buffer = (buffer << 8) | u64::from(*byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(char::from(ALPHABET[((buffer >> bits) & 31) as usize]));
        }
    }
    if bits > 0 {
        out.push(char::from(ALPHABET[((buffer << (5 - bits)) & 31) as usize]));
    }
    out
}

fn hash(s: &str, len: usize) -> String {
    let mut encoded = base32(&sha256(s.as_bytes()));
    encoded.truncate(len);
    encoded
}

/// iptables `portProtoHash`: the suffix of KUBE-SVC-/SVL-/EXT-/FW- chains.
/// `service_port_name` is "ns/name" or "ns/name:port"; `protocol`
/// lower case.
pub fn port_proto_hash(service_port_name: &str, protocol: &str) -> String {
    hash(&format!("{service_port_name}{protocol}"), 16)
}

/// iptables KUBE-SEP- suffix; `endpoint` is "ip:port" ("[ip6]:port").
pub fn endpoint_hash(service_port_name: &str, protocol: &str, endpoint: &str) -> String {
    hash(&format!("{service_port_name}{protocol}{endpoint}"), 16)
}

/// nftables `hashAndTruncate`: "HASH8-name", cut to 240 characters.
pub fn hash_and_truncate(name: &str) -> String {
    const MAX: usize = 240;
    let mut out = format!("{}-{name}", hash(name, 8));
    if out.len() > MAX {
        out.truncate(MAX - 3);
        out.push_str("...");
    }
    out
}

/// nftables `servicePortChainNameBase`: "HASH-ns/name/proto/port".
pub fn nft_service_base(namespace: &str, name: &str, protocol: &str, port_name: &str) -> String {
    hash_and_truncate(&format!("{namespace}/{name}/{protocol}/{port_name}"))
}

/// nftables `servicePortEndpointChainNameBase`:
/// "HASH-ns/name/proto/port__ip/port", IPv6 colons as dots.
pub fn nft_endpoint_base(
    namespace: &str,
    name: &str,
    protocol: &str,
    port_name: &str,
    ip: std::net::IpAddr,
    port: u16,
) -> String {
    let ip = ip.to_string().replace(':', ".");
    hash_and_truncate(&format!(
        "{namespace}/{name}/{protocol}/{port_name}__{ip}/{port}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn sha256_and_base32_match_their_standards() {
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        // Two blocks (56 bytes: the length no longer fits the first).
        assert_eq!(
            hex(&sha256(
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
            )),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        assert_eq!(base32(b"foobar"), "MZXW6YTBOI");
        assert_eq!(base32(b"fooba"), "MZXW6YTB");
        assert_eq!(base32(b"f"), "MY");
    }

    /// The hashes upstream's tests fix and kube-proxy itself produced.
    #[test]
    fn chain_hashes_are_upstreams() {
        assert_eq!(port_proto_hash("ns1/svc1:p80", "tcp"), "XPGD46QRK7WJZT7O");
        assert_eq!(
            endpoint_hash("ns1/svc1:p80", "tcp", "10.180.0.1:80"),
            "SXIVWICOYRO3J4NJ"
        );
        assert_eq!(
            port_proto_hash("default/web:http", "tcp"),
            "CDGGSHYLG3RE2FKL"
        );
        assert_eq!(
            endpoint_hash("default/web:http", "tcp", "10.244.1.10:8080"),
            "GWQABTP5GBYXHJY5"
        );
        assert_eq!(
            endpoint_hash("default/web:http", "tcp", "10.244.1.2:8080"),
            "UIQK3OSOSTRHRPBX"
        );
        assert_eq!(
            endpoint_hash("default/web:http", "tcp", "10.244.2.7:8080"),
            "2RIJ5GIYXEFH6G4D"
        );
        assert_eq!(
            nft_service_base("ns1", "svc1", "tcp", "p80"),
            "ULMVA6XW-ns1/svc1/tcp/p80"
        );
        assert_eq!(
            nft_endpoint_base(
                "ns1",
                "svc1",
                "tcp",
                "p80",
                "10.180.0.1".parse().unwrap(),
                80
            ),
            "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        );
        assert_eq!(
            nft_service_base("default", "web", "tcp", "http"),
            "SUSTUHLJ-default/web/tcp/http"
        );
        assert_eq!(
            nft_endpoint_base(
                "default",
                "web",
                "tcp",
                "http",
                "10.244.1.2".parse().unwrap(),
                8080
            ),
            "SVLGPL42-default/web/tcp/http__10.244.1.2/8080"
        );
        assert_eq!(
            nft_endpoint_base(
                "default",
                "web",
                "tcp",
                "http",
                "10.244.2.7".parse().unwrap(),
                8080
            ),
            "BZGFZVVG-default/web/tcp/http__10.244.2.7/8080"
        );
        let v6 = nft_endpoint_base("ns", "s", "udp", "", "fd00::1".parse().unwrap(), 53);
        assert!(v6.ends_with("-ns/s/udp/__fd00..1/53"), "{v6}");
    }
}
