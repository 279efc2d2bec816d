/*
 * The client handshake: SOCKS5 (with user/password), HTTP CONNECT, mixed.
 * See conn.c for the design.
 */
#define _GNU_SOURCE
#include "conn_int.h"

/* ---- client handshake ------------------------------------------------------------ */

static const struct user *find_user(const struct listener *l, const uint8_t *name, size_t nlen)
{
    for (size_t i = 0; i < l->nusers; i++) {
        if (strlen(l->users[i].name) == nlen && memcmp(l->users[i].name, name, nlen) == 0)
            return &l->users[i];
    }
    return NULL;
}

/* Constant-time in the password length, like hmac.compare_digest. */
static bool pass_ok(const struct user *u, const uint8_t *pass, size_t plen)
{
    if (!u)
        return false;
    uint8_t diff = (uint8_t)(u->pass_len != plen);
    size_t n = plen < u->pass_len ? plen : u->pass_len;
    for (size_t i = 0; i < n; i++)
        diff |= (uint8_t)(u->pass[i] ^ pass[i]);
    return diff == 0;
}

static void s5_fail(struct cconn *c, const uint8_t *reply, size_t len)
{
    if (len)
        (void)client_send(c, reply, len);
    conn_drop(c);
}

/* Run the handshake on what the client sent so far. */
void handshake_step(struct cconn *c)
{
    uint8_t reply[SW_PARSE_REPLY_MAX];
    size_t rlen = 0;
    for (;;) {
        const uint8_t *p = c->buf + c->consumed;
        size_t n = c->len - c->consumed;
        int rc;
        switch (c->state) {
        case ST_HS_FIRST:
            if (n == 0)
                return;
            if (p[0] == 5) {
                c->proto = 1;
                c->state = ST_S5_GREETING;
            } else {
                c->proto = 2;
                c->state = ST_HTTP_HEAD;
            }
            continue;
        case ST_S5_GREETING: {
            sw_s5_greeting g;
            rc = sw_parse_s5_greeting(p, n, &g, reply, &rlen);
            if (rc == SW_PARSE_NEED_MORE)
                return;
            if (rc == SW_PARSE_DEFER) {
                /* Nothing written yet: Python can take the whole handshake. */
                conn_defer(c, SW_DEFER_HANDSHAKE);
                return;
            }
            if (rc != SW_PARSE_OK) {
                s5_fail(c, reply, rlen);
                return;
            }
            c->consumed += g.consumed;
            uint8_t sel[2] = {5, 0xFF};
            if (c->listener->opts.users_required) {
                if (!g.userpass) {
                    s5_fail(c, sel, 2);
                    return;
                }
                sel[1] = 2;
                c->state = ST_S5_USERPASS;
            } else {
                if (!g.no_auth) {
                    s5_fail(c, sel, 2);
                    return;
                }
                sel[1] = 0;
                c->state = ST_S5_REQUEST;
            }
            if (client_send(c, sel, 2) < 0) {
                conn_drop(c);
                return;
            }
            continue;
        }
        case ST_S5_USERPASS: {
            sw_s5_userpass up;
            rc = sw_parse_s5_userpass(p, n, &up, reply, &rlen);
            if (rc == SW_PARSE_NEED_MORE)
                return;
            if (rc != SW_PARSE_OK) {
                s5_fail(c, reply, rlen);
                return;
            }
            const struct user *u = find_user(c->listener, p + up.user_off, up.user_len);
            bool ok = pass_ok(u, p + up.pass_off, up.pass_len);
            c->consumed += up.consumed;
            static const uint8_t good[2] = {1, 0}, bad[2] = {1, 1};
            if (!ok) {
                s5_fail(c, bad, 2);
                return;
            }
            if (client_send(c, good, 2) < 0) {
                conn_drop(c);
                return;
            }
            c->principal = u->principal;
            c->auth = SW_CAUTH_USERPASS;
            c->state = ST_S5_REQUEST;
            continue;
        }
        case ST_S5_REQUEST: {
            sw_s5_request rq;
            rc = sw_parse_s5_request(p, n, &rq, reply, &rlen);
            if (rc == SW_PARSE_NEED_MORE)
                return;
            if (rc != SW_PARSE_OK) {
                s5_fail(c, reply, rlen);
                return;
            }
            c->consumed += rq.consumed;
            if (rq.command != 1 && rq.command != 3) {
                /* BIND is not offered (as the Python path). */
                static const uint8_t unsupported[10] = {5, 7, 0, 1, 0, 0, 0, 0, 0, 0};
                s5_fail(c, unsupported, sizeof unsupported);
                return;
            }
            if (rq.command == 1) {
                set_host(c, rq.host, rq.host_len);
            } else {
                /* An association's declared source (0.0.0.0 is "any"): as given. */
                memcpy(c->host, rq.host, rq.host_len);
                c->host[rq.host_len] = 0;
                c->host_len = rq.host_len;
            }
            c->port = rq.port;
            c->command = rq.command;
            timer_clear(c);
            if (rq.command == 3) {
                /* An association is Python's (its UDP socket, its flows); the
                 * handshake is done, the reply is Python's to send. */
                conn_defer(c, SW_DEFER_ROUTE);
                return;
            }
            after_handshake(c);
            return;
        }
        case ST_HTTP_HEAD: {
            sw_http_connect h;
            rc = sw_parse_http_connect(p, n, &h);
            if (rc == SW_PARSE_NEED_MORE) {
                if (c->len >= SW_CONN_RAW_MAX)
                    conn_defer(c, SW_DEFER_HANDSHAKE);
                return;
            }
            if (rc != SW_PARSE_OK) {
                /* Not a CONNECT C takes: maybe a request C forwards itself. */
                if (c->listener->opts.forward && !c->listener->opts.users_required) {
                    int fr = fwd_try(c, p, n);
                    if (fr > 0)
                        return;
                    if (fr == 0 && c->len < SW_CONN_RAW_MAX)
                        return;
                }
                conn_defer(c, SW_DEFER_HANDSHAKE);
                return;
            }
            if (c->listener->opts.users_required) {
                const struct user *u =
                    h.has_creds ? find_user(c->listener, (const uint8_t *)h.user, h.user_len)
                                : NULL;
                if (!h.has_creds || !pass_ok(u, (const uint8_t *)h.pass, h.pass_len)) {
                    /* The 407 and its wording are Python's: let it answer. */
                    conn_defer(c, SW_DEFER_HANDSHAKE);
                    return;
                }
                c->principal = u->principal;
                c->auth = SW_CAUTH_BASIC;
            }
            c->consumed += h.consumed;
            set_host(c, h.host, h.host_len);
            c->port = h.port;
            timer_clear(c);
            after_handshake(c);
            return;
        }
        default:
            return;
        }
    }
}
