/*
 * spliceway compiled route tables: what Python decided about routing (rules,
 * mode, the outbound each route target currently leads to), compiled into an
 * immutable structure the C connection path reads without a lock.
 *
 * Life of a table: sw_table_new, then the sw_table_* builders (single
 * thread, Python, at config/selection change time), then sw_table_seal, which
 * builds the indexes.  A sealed table is immutable and may be read by any
 * number of threads; conn.c publishes it with an atomic pointer swap and frees
 * the old one once every loop has passed a quiescent point.
 *
 * The reference is spliceway/routing/rules.py (decide()); the shared sets
 * (rule sets, GEOIP, GEOSITE) are route_set.c.  sw_table_decide either gives
 * the rule / target of routing.decide's decision (a configured rule may be
 * several table rules: spliceway/native/route.py maps them back), or
 * SW_ROUTE_DEFER when the first rule that could match needs a condition C
 * does not check (domain_regex; process_name for a client on this host) or a
 * domain target's address it was not given (a resolving rule ranked at or
 * before the match: routing.needs_address): tests/csrc/test_route_diff.py
 * and test_route_sets_diff.py hold it to that on random configs x targets.
 */
#ifndef SW_ROUTE_H
#define SW_ROUTE_H

#include <stddef.h>
#include <stdint.h>

/* SW_CDEF_BEGIN */

typedef struct sw_table sw_table;

enum sw_route_action {
    SW_ROUTE_ROUTE = 1, /* go to `target` */
    SW_ROUTE_BLOCK = 2, /* a block rule matched */
    SW_ROUTE_DEFER = 3  /* Python must decide */
};

enum sw_mode_kind {
    SW_MODE_RULE = 1,
    SW_MODE_GLOBAL = 2, /* everything to mode_target */
    SW_MODE_DIRECT = 3  /* everything to mode_target (Python passes "direct"'s index) */
};

enum sw_cond_field {
    SW_COND_DST = 0,    /* ip_cidr / port: the target */
    SW_COND_SRC = 1     /* source_ip_cidr / source_port */
};

enum sw_domain_kind {
    SW_DOMAIN_EXACT = 1,   /* domain */
    SW_DOMAIN_SUFFIX = 2,  /* domain_suffix */
    SW_DOMAIN_KEYWORD = 3  /* domain_keyword */
};

enum sw_network {
    SW_NET_TCP = 1,
    SW_NET_UDP = 2
};

/* What an outbound target is to the C path. */
enum sw_out_kind {
    SW_OUT_DEFER = 0,   /* Python dials it (shadowsocks, relay chains, load_balance...) */
    SW_OUT_DIRECT = 1,
    SW_OUT_BLOCK = 2,
    SW_OUT_SOCKS5 = 3,
    SW_OUT_HTTP = 4
};

#define SW_NO_PRINCIPAL 4294967295

typedef struct sw_route_query {
    const char *host;      /* target host text as the handshake gave it */
    uint32_t host_len;
    const char *sniffed;   /* sniffed host or NULL */
    uint32_t sniffed_len;
    uint16_t port;
    uint16_t source_port;
    uint8_t source_family; /* 4, 6 or 0 (unknown) */
    uint8_t network;       /* enum sw_network */
    uint8_t reserved[2];
    uint8_t source_ip[16]; /* 4 bytes for IPv4 (IPv4-mapped already unmapped) */
    uint32_t inbound;      /* inbound index (config order) */
    uint32_t principal;    /* principal id, SW_NO_PRINCIPAL when none */
    /* The address a domain target resolved to (routing.FlowFacts.resolved_ip):
     * family 4 or 6 (0: none), 4 or 16 bytes.  Without it, a name whose route
     * an ip_cidr rule could change defers (see sw_table_first_ip_rule). */
    uint8_t resolved_family;
    uint8_t reserved2[3];
    uint8_t resolved_ip[16];
} sw_route_query;

typedef struct sw_route_result {
    int32_t action;  /* enum sw_route_action */
    int32_t rule;    /* matched rule index, -1 when none (final, global, direct) */
    int32_t target;  /* target index when action is SW_ROUTE_ROUTE, else -1 */
    int32_t reserved;
} sw_route_result;

/* nrules rules and ntargets targets, all initially empty; epoch is an opaque
 * number Python uses to find its own mirror of the table. */
int sw_table_new(uint32_t nrules, uint32_t ntargets, uint64_t epoch, sw_table **out);
void sw_table_free(sw_table *table);
uint64_t sw_table_epoch(const sw_table *table);

/* kind: enum sw_mode_kind.  final_target: the "no rule matched" target of
 * rule mode; mode_target: the global/direct target (-1 in rule mode). */
int sw_table_set_mode(sw_table *table, int kind, int32_t mode_target, int32_t final_target);
/* action: SW_ROUTE_ROUTE (with target) or SW_ROUTE_BLOCK (target -1). */
int sw_table_rule(sw_table *table, uint32_t rule, int action, int32_t target);
/* Conditions: a rule matches when every condition kind it has matches; within
 * a kind, any item.  Several calls of the same kind add items. */
int sw_table_cond_domain(sw_table *table, uint32_t rule, int kind, const char *value);
int sw_table_cond_cidr(sw_table *table, uint32_t rule, int field, int family,
                       const uint8_t *addr, int prefix);
int sw_table_cond_port(sw_table *table, uint32_t rule, int field, uint16_t lo, uint16_t hi);
int sw_table_cond_network(sw_table *table, uint32_t rule, int network);
int sw_table_cond_inbound(sw_table *table, uint32_t rule, uint32_t inbound);
int sw_table_cond_principal(sw_table *table, uint32_t rule, uint32_t principal);
/* The rule also has a condition only Python can check (domain_regex):
 * reaching it with every other condition matching defers. */
int sw_table_cond_opaque(sw_table *table, uint32_t rule);

/* How a process_name condition is decided (runtime.process_lookup).  Only
 * Python knows the process behind a flow, and only when the client is on
 * this host: a source in 127/8 or ::1 (IPv4-mapped read as IPv4), or one of
 * the addresses sw_table_local_addr named. */
enum sw_process_mode {
    SW_PROCESS_OFF = 0,   /* no lookups: a process condition never holds */
    SW_PROCESS_RULES = 1, /* the default: unknown (so the rule defers) for a
                             source on this host, false for any other */
    SW_PROCESS_ALL = 2    /* as RULES, and every flow from a source on this
                             host goes to Python before routing
                             (sw_table_source_deferred) */
};
/* The rule has a process_name condition (see sw_process_mode). */
int sw_table_cond_process(sw_table *table, uint32_t rule);
/* mode: enum sw_process_mode. */
int sw_table_set_process(sw_table *table, int mode);
/* One of this host's addresses: family 4 or 6, addr 4 or 16 bytes (network
 * order; IPv4-mapped IPv6 is taken as IPv4).  Any number. */
int sw_table_local_addr(sw_table *table, int family, const uint8_t *addr);
/* 1 when the table's mode is SW_PROCESS_ALL and a source (family 4 or 6, ip
 * 4 or 16 bytes as sw_route_query.source_ip) is on this host: the connection
 * path hands such a flow to Python after its handshake, before routing, so
 * Python finds its process first.  Not a routing decision: sw_table_decide
 * ignores it. */
int sw_table_source_deferred(const sw_table *table, int family, const uint8_t *ip);
/* Target `index`: kind enum sw_out_kind; server/port/user/pass for socks5 and
 * http (user NULL = no credentials); server is an IP literal or a name
 * looked up in the DNS cache.  Strings are copied. */
int sw_table_target(sw_table *table, uint32_t index, int kind, const char *server,
                    uint16_t port, const char *user, const char *pass,
                    uint32_t connect_timeout_ms);
/* The outbound tag target `index` reaches (after sw_table_target): the C path
 * names it in failure messages, as the Python outbounds do. */
int sw_table_target_tag(sw_table *table, uint32_t index, const char *tag);
/* Listener slots sw_table_defer_inbound takes (conn.c's MAX_LISTENERS). */
#define SW_TABLE_INBOUND_SLOTS 256
/* Every flow of listener slot `inbound` goes to Python after its handshake,
 * before any route is decided (Python asks the flow hook there first).  Not a
 * routing decision: sw_table_decide ignores it; the connection path asks
 * sw_table_inbound_deferred.  -ERANGE for a slot >= SW_TABLE_INBOUND_SLOTS. */
int sw_table_defer_inbound(sw_table *table, uint32_t inbound);
/* 1 when sw_table_defer_inbound named `inbound`, else 0. */
int sw_table_inbound_deferred(const sw_table *table, uint32_t inbound);
/* Networks sw_table_defer_cidr takes (fake-ip ranges: one or two). */
#define SW_TABLE_DEFER_NETS 8
/* A flow whose target host is an IP literal in family/addr/prefix (4 or 16
 * bytes, network order) goes to Python after its handshake, before routing:
 * a fake-ip address, which Python maps back to its domain.  Not a routing
 * decision: sw_table_decide ignores it; the connection path asks
 * sw_table_host_deferred.  -ENOSPC past SW_TABLE_DEFER_NETS networks. */
int sw_table_defer_cidr(sw_table *table, int family, const uint8_t *addr, int prefix);
/* 1 when `host` (the target text, as sw_route_query.host) is an IP literal in
 * a network sw_table_defer_cidr named (IPv4-mapped IPv6 read as IPv4, as
 * routing._parse_ip does), or a scoped IPv6 literal while any is named. */
int sw_table_host_deferred(const sw_table *table, const char *host, uint32_t host_len);
/* ---- shared sets (rule sets, GEOIP countries, GEOSITE lists) -------------
 *
 * A set is an OR over items of any kind: names, keywords, networks, ports,
 * networks (tcp/udp), plus flags for items only Python checks.  It is built
 * once (sw_set_new, the sw_set_* builders, sw_set_seal), from then on
 * immutable, and shared by reference: sw_table_cond_sets takes a reference
 * for the table, which drops it when freed, so one set of 300,000 names
 * serves every table compiled while its content stays the same (a new
 * selection or mode recompiles the rules, not the sets).  The reference
 * counts are atomic: a set may be freed by the thread that frees the last
 * table using it.  Names are hashed (reversed, as the tables' domains),
 * keywords go to an Aho-Corasick automaton, networks to merged sorted
 * intervals per family: a lookup costs O(host length) + O(log networks)
 * whatever the set's size. */
typedef struct sw_set sw_set;

enum sw_set_item {
    SW_SET_EXACT = 1,     /* the host equals the item */
    SW_SET_SUFFIX = 2,    /* the host equals it or ends with "." + it */
    SW_SET_SUBDOMAIN = 3, /* the host ends with "." + it (not the item itself) */
    SW_SET_WILDCARD = 4,  /* label by label, a "*" label matching any one label */
    SW_SET_KEYWORD = 5    /* the host contains it */
};

enum sw_set_flag {
    /* An item only Python checks on a domain name (domain_regex): unknown
     * for a flow with a domain name, false for one without. */
    SW_SET_F_DOMAIN_OPAQUE = 1,
    /* An item only Python checks at all: unknown for every flow. */
    SW_SET_F_OPAQUE = 2,
    /* A process_name item: as sw_table_cond_process (the table's
     * sw_process_mode decides). */
    SW_SET_F_PROCESS = 4
};

/* A new, empty, unsealed set with one reference (the caller's). */
int sw_set_new(sw_set **out);
/* Drops one reference; the last frees the set.  NULL is ignored. */
void sw_set_free(sw_set *set);
/* Items of `kind` (enum sw_set_item): `len` bytes of NUL-terminated strings,
 * one after the other (the last one terminated too; empty strings allowed).
 * They are compared as given but ASCII-lowercased: the caller normalises
 * (str.lower, trailing dot) as its reference does.  -EINVAL for an unsealed
 * set's misuse or a buffer not ending in NUL. */
int sw_set_domains(sw_set *set, int kind, const char *buf, size_t len);
/* `n` networks of one family (4 or 6): addrs holds n * 4 or n * 16 bytes
 * (network order), prefixes n prefix lengths.  field SW_COND_DST (ip_cidr)
 * or SW_COND_SRC (source_ip_cidr).  ::ffff:a.b.c.d/m (m >= 96) also covers
 * a.b.c.d/(m-96) as IPv4, as sw_table_cond_cidr. */
int sw_set_cidrs(sw_set *set, int field, int family, const uint8_t *addrs,
                 const uint8_t *prefixes, size_t n);
int sw_set_port(sw_set *set, int field, uint16_t lo, uint16_t hi);
int sw_set_network(sw_set *set, int network);
/* enum sw_set_flag bits, or-ed in. */
int sw_set_flags(sw_set *set, uint32_t flags);
/* Builds the lookups; afterwards the set is immutable and may be used by
 * tables on any thread. */
int sw_set_seal(sw_set *set);

typedef struct sw_set_info {
    uint64_t bytes;     /* heap bytes the set holds (allocator overhead aside) */
    uint32_t names;     /* distinct names (exact, suffix, subdomain, "*.x" wildcards) */
    uint32_t keywords;  /* distinct keywords */
    uint32_t wildcards; /* other wildcard patterns (matched one by one) */
    uint32_t nets4;     /* merged IPv4 intervals, both fields */
    uint32_t nets6;
    uint32_t ports;     /* merged port ranges, both fields */
    uint32_t flags;     /* enum sw_set_flag */
    uint32_t reserved;
} sw_set_info;

int sw_set_info_get(const sw_set *set, sw_set_info *out);
/* 1 when a domain item of a sealed set (name, wildcard or keyword) matches
 * `host` (one trailing dot ignored, ASCII case-insensitive), else 0;
 * -EINVAL for an unsealed set. */
int sw_set_has_name(const sw_set *set, const char *host, uint32_t len);
/* 1 when a network of `field` holds addr (family 4 or 6, 4 or 16 bytes; a
 * mapped IPv6 address is read as IPv4), else 0; -EINVAL as above. */
int sw_set_has_addr(const sw_set *set, int field, int family, const uint8_t *addr);

enum sw_setcond_flag {
    /* The sets' ip_cidr items look at the source address
     * (rule_set_ip_cidr_match_source, source_geoip). */
    SW_SETCOND_SOURCE = 1,
    /* The condition holds when none of the sets does (unknown stays unknown). */
    SW_SETCOND_INVERT = 2
};

/* A condition of `rule` that holds when any of the `n` sealed sets does
 * (rule_set, geoip, geosite...).  Each call adds one more condition, and a
 * rule matches only when all of its conditions do: two calls are two
 * conditions (AND), one call with two sets one (OR).  The table takes a
 * reference on each set. */
int sw_table_cond_sets(sw_table *table, uint32_t rule, uint32_t flags, sw_set *const *sets,
                       uint32_t n);

/* Resolving (routing.first_ip_rule, mihomo's ShouldResolveIP): the first
 * rule that resolves is sw_table_first_ip_rule.  A domain target reaching it
 * without an address defers (Python resolves the name); the rules from it on
 * see resolved_ip, the rules before it only an IP-literal target.  A rule
 * resolves when it has SW_RULE_RESOLVES, or an ip_cidr condition and not
 * SW_RULE_NO_RESOLVE (set conditions resolve only by the flag: whether a
 * set wants the address is the caller's to say). */
enum sw_rule_flag {
    /* The rule's ip_cidr conditions do not make it resolve. */
    SW_RULE_NO_RESOLVE = 1,
    /* The rule matches when its conditions do not all hold (unknown stays
     * unknown). */
    SW_RULE_INVERT = 2,
    /* The rule resolves (see above). */
    SW_RULE_RESOLVES = 4,
    /* The rule and the one before it are alternatives of one configured rule
     * (same action and target): when the first of a group that is not false
     * is unknown, a later one that holds decides instead of a deferral. */
    SW_RULE_GROUPED = 8
};

/* enum sw_rule_flag bits, or-ed in. */
int sw_table_rule_flags(sw_table *table, uint32_t rule, uint32_t flags);

/* Builds the indexes; afterwards only sw_table_decide and the getters. */
int sw_table_seal(sw_table *table);

/* Route one flow.  Returns 0, or -EINVAL for an unsealed table. */
int sw_table_decide(const sw_table *table, const sw_route_query *query, sw_route_result *out);
/* Index of the first rule with a domain condition (nrules when none): a
 * sniffed host can change a decision only if this is below the matched rule. */
int32_t sw_table_first_domain_rule(const sw_table *table);
/* Index of the first rule that resolves (see enum sw_rule_flag; nrules when
 * none, 0 for an unsealed table): a domain target's address can change a
 * decision only if this is at or below the matched rule
 * (routing.RuleSet.first_ip_rule). */
uint32_t sw_table_first_ip_rule(const sw_table *table);

/* SW_CDEF_END */

/* For conn.c (not part of the cdef). */
typedef struct sw_target_info {
    int kind;               /* enum sw_out_kind */
    const char *server;     /* NUL-terminated; NULL for direct/block/defer */
    uint16_t port;
    const char *user;       /* NULL = no credentials */
    const char *pass;
    uint32_t connect_timeout_ms;
    const char *tag;        /* the leaf outbound's tag; NULL when not given */
} sw_target_info;

/* NULL when index is out of range. */
const sw_target_info *sw_table_target_info(const sw_table *table, uint32_t index);
/* The mode kind (enum sw_mode_kind). */
int sw_table_mode(const sw_table *table);
/* How many rules the table has. */
uint32_t sw_table_rule_count(const sw_table *table);

#endif /* SW_ROUTE_H */
