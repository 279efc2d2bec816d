/* Scaffold: replaced by the real table (every decision deferred until then). */
#include "route.h"
#include <errno.h>
#include <stdlib.h>
struct sw_table { uint64_t epoch; };
int sw_table_new(uint32_t nrules, uint32_t ntargets, uint64_t epoch, sw_table **out) { (void)nrules; (void)ntargets; *out = calloc(1, sizeof(sw_table)); if (!*out) return -ENOMEM; (*out)->epoch = epoch; return 0; }
void sw_table_free(sw_table *t) { free(t); }
uint64_t sw_table_epoch(const sw_table *t) { return t->epoch; }
int sw_table_set_mode(sw_table *t, int k, int32_t m, int32_t f) { (void)t; (void)k; (void)m; (void)f; return 0; }
int sw_table_rule(sw_table *t, uint32_t r, int a, int32_t g) { (void)t; (void)r; (void)a; (void)g; return 0; }
int sw_table_cond_domain(sw_table *t, uint32_t r, int k, const char *v) { (void)t; (void)r; (void)k; (void)v; return 0; }
int sw_table_cond_cidr(sw_table *t, uint32_t r, int f, int fam, const uint8_t *a, int p) { (void)t; (void)r; (void)f; (void)fam; (void)a; (void)p; return 0; }
int sw_table_cond_port(sw_table *t, uint32_t r, int f, uint16_t lo, uint16_t hi) { (void)t; (void)r; (void)f; (void)lo; (void)hi; return 0; }
int sw_table_cond_network(sw_table *t, uint32_t r, int n) { (void)t; (void)r; (void)n; return 0; }
int sw_table_cond_inbound(sw_table *t, uint32_t r, uint32_t i) { (void)t; (void)r; (void)i; return 0; }
int sw_table_cond_principal(sw_table *t, uint32_t r, uint32_t p) { (void)t; (void)r; (void)p; return 0; }
int sw_table_cond_opaque(sw_table *t, uint32_t r) { (void)t; (void)r; return 0; }
int sw_table_target(sw_table *t, uint32_t i, int k, const char *s, uint16_t p, const char *u, const char *pw, uint32_t c) { (void)t; (void)i; (void)k; (void)s; (void)p; (void)u; (void)pw; (void)c; return 0; }
int sw_table_seal(sw_table *t) { (void)t; return 0; }
int sw_table_decide(const sw_table *t, const sw_route_query *q, sw_route_result *o) { (void)t; (void)q; o->action = SW_ROUTE_DEFER; o->rule = -1; o->target = -1; o->reserved = 0; return 0; }
int32_t sw_table_first_domain_rule(const sw_table *t) { (void)t; return 0; }
const sw_target_info *sw_table_target_info(const sw_table *t, uint32_t i) { (void)t; (void)i; return NULL; }
int sw_table_mode(const sw_table *t) { (void)t; return SW_MODE_RULE; }
