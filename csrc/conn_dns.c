/*
 * The DNS answer cache the dialler reads and Python fills (sw_conn_dns_*).
 * See conn.c for the design.
 */
#define _GNU_SOURCE
#include "conn_int.h"

/* ---- DNS answer cache ---------------------------------------------------- */

/* Address i of the connection's list as a socket address. */
void addr_select(struct cconn *c, uint8_t i)
{
    struct sockaddr_storage *ss = &c->up_addr;
    memset(ss, 0, sizeof *ss);
    c->addr_idx = i;
    if (c->addr_family[i] == 4) {
        struct sockaddr_in *sin = (struct sockaddr_in *)ss;
        sin->sin_family = AF_INET;
        sin->sin_port = htons(c->up_port);
        memcpy(&sin->sin_addr, c->addr_raw[i], 4);
        c->up_addr_len = sizeof *sin;
    } else {
        struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)ss;
        sin6->sin6_family = AF_INET6;
        sin6->sin6_port = htons(c->up_port);
        memcpy(&sin6->sin6_addr, c->addr_raw[i], 16);
        c->up_addr_len = sizeof *sin6;
    }
}

/* The cached addresses of `host` into the connection (and the first selected). */
bool dns_get(sw_conn *conn, const char *host, struct cconn *c, uint16_t port)
{
    uint32_t b = hash_str(host) % DNS_BUCKETS;
    uint64_t now = sw_mono_ms();
    bool found = false;
    pthread_mutex_lock(&conn->dns_lock);
    for (struct dns_entry *e = conn->dns[b]; e; e = e->next) {
        if (e->expires > now && strcmp(e->host, host) == 0) {
            c->naddrs = e->n;
            memcpy(c->addr_family, e->family, e->n);
            memcpy(c->addr_raw, e->addr, (size_t)e->n * 16);
            found = true;
            break;
        }
    }
    pthread_mutex_unlock(&conn->dns_lock);
    if (found) {
        c->up_port = port;
        addr_select(c, 0);
    }
    return found;
}

static void dns_purge_locked(sw_conn *conn, uint64_t now)
{
    for (size_t b = 0; b < DNS_BUCKETS; b++) {
        struct dns_entry **pp = &conn->dns[b];
        while (*pp) {
            struct dns_entry *e = *pp;
            if (e->expires <= now) {
                *pp = e->next;
                free(e);
                conn->dns_count--;
            } else {
                pp = &e->next;
            }
        }
    }
}

void sw_conn_dns_flush(sw_conn *conn)
{
    if (!conn)
        return;
    pthread_mutex_lock(&conn->dns_lock);
    dns_purge_locked(conn, UINT64_MAX);
    pthread_mutex_unlock(&conn->dns_lock);
}

int sw_conn_dns_put(sw_conn *conn, const char *host, uint32_t n, const uint8_t *families,
                    const uint8_t *addrs, uint32_t ttl_ms)
{
    if (!conn || !host || !families || !addrs || n == 0 || n > SW_DNS_MAX_ADDRS)
        return -EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (families[i] != 4 && families[i] != 6)
            return -EINVAL;
    size_t len = strlen(host);
    if (len == 0 || len >= SW_HOST_MAX)
        return -EINVAL;
    uint64_t now = sw_mono_ms();
    uint32_t b = hash_str(host) % DNS_BUCKETS;
    pthread_mutex_lock(&conn->dns_lock);
    struct dns_entry *e = conn->dns[b];
    for (; e; e = e->next)
        if (strcmp(e->host, host) == 0)
            break;
    if (!e) {
        if (conn->dns_count >= DNS_MAX_ENTRIES)
            dns_purge_locked(conn, now);
        if (conn->dns_count >= DNS_MAX_ENTRIES) {
            pthread_mutex_unlock(&conn->dns_lock);
            return -ENOSPC;
        }
        e = calloc(1, sizeof *e + len + 1);
        if (!e) {
            pthread_mutex_unlock(&conn->dns_lock);
            return -ENOMEM;
        }
        memcpy(e->host, host, len + 1);
        e->next = conn->dns[b];
        conn->dns[b] = e;
        conn->dns_count++;
    }
    e->n = (uint8_t)n;
    memcpy(e->family, families, n);
    memset(e->addr, 0, sizeof e->addr);
    for (uint32_t i = 0; i < n; i++)
        memcpy(e->addr[i], addrs + 16 * i, families[i] == 4 ? 4 : 16);
    e->expires = now + ttl_ms;
    pthread_mutex_unlock(&conn->dns_lock);
    return 0;
}
