/*
 * kvtier_offload._native: the block store's hot path (see batchio.py for the contract).
 *
 * A whole batch of block files opened, read or written, header built and checked and the
 * payload's XXH3-64 computed while its bytes are in cache, with the GIL released for the
 * whole batch. Any outcome but the common one is reported NOT_DONE and the caller redoes
 * that block on its Python path, which owns every error, metric and log line.
 *
 * Built on the stable ABI (Py_LIMITED_API, Python 3.11+): one .abi3.so per platform.
 * xxHash is compiled in (XXH_INLINE_ALL): nothing but libc is needed at run time.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#include "xxh3_dispatch.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* The file format (fileformat.py) and layout (layout.py); batchio.py checks that these
 * equal the Python constants before it uses this module. */
#define FORMAT_VERSION 4
#define HEADER_SIZE 4096
#define LENGTH_OFFSET 16
#define DIGEST_OFFSET 24
#define KEY_LEN_OFFSET 32
#define KEY_OFFSET 34
#define PREFIX_SIZE LENGTH_OFFSET
#define MIN_KEY_BYTES 4
#define MAX_KEY_BYTES 114
#define SUFFIX ".kvb"
#define TEMP_SUFFIX ".tmp"

enum { DONE = 0, NOT_DONE = 1, EXISTS = 2 };
/* The calling convention of read_batch/write_batch/open_beneath: native.py refuses an
 * extension built for another. 2: paths are resolved beneath a directory fd. */
#define BATCH_API 2

static uint32_t crc_table[256];

/* XXH3 of this file's (baseline) build, replaced at import by a wider one the CPU has */
static uint64_t base_hash(const void *data, size_t len)
{
    return XXH3_64bits(data, len);
}

static int base_reset(void *state)
{
    return XXH3_64bits_reset(state) == XXH_OK;
}

static int base_update(void *state, const void *data, size_t len)
{
    return XXH3_64bits_update(state, data, len) == XXH_OK;
}

static uint64_t base_digest(const void *state)
{
    return XXH3_64bits_digest(state);
}

static kvtier_xxh3 xxh3 = {"baseline", base_hash, base_reset, base_update, base_digest};

static void crc_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* zlib's crc32 of data, starting from 0 */
static uint32_t crc32_of(const unsigned char *data, size_t n)
{
    uint32_t crc = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++)
        crc = crc_table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
    return crc ^ 0xFFFFFFFFu;
}

static void put_le(unsigned char *out, uint64_t value, int bytes)
{
    for (int i = 0; i < bytes; i++)
        out[i] = (unsigned char)(value >> (8 * i));
}

static uint64_t get_le64(const unsigned char *in)
{
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--)
        value = (value << 8) | in[i];
    return value;
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------- names and headers */

typedef struct {
    const char *base;
    size_t base_len;
    const unsigned char *prefix; /* PREFIX_SIZE bytes: magic, version, size, fingerprint */
    const unsigned char *keys;   /* all keys, one after another */
    const int64_t *bounds;       /* key i is keys[bounds[i]:bounds[i + 1]] */
    const char *token;           /* temp names: ".<name>.<token>.tmp"; NULL: final names */
    size_t token_len;
} Names;

static size_t path_capacity(const Names *names)
{
    return names->base_len + 8 + 2 * MAX_KEY_BYTES + sizeof SUFFIX + names->token_len
           + sizeof TEMP_SUFFIX + 2;
}

static char *hex_into(char *out, const unsigned char *data, size_t n)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        *out++ = digits[data[i] >> 4];
        *out++ = digits[data[i] & 15];
    }
    return out;
}

/* Layout.path (temp: Layout.temp_path) of key i, NUL-terminated, into out
 * (path_capacity bytes). Keys are MIN_KEY_BYTES or longer (checked on entry). */
static void path_into(char *out, const Names *names, Py_ssize_t i, int temp)
{
    const unsigned char *key = names->keys + names->bounds[i];
    size_t len = (size_t)(names->bounds[i + 1] - names->bounds[i]);
    char *p = out;
    memcpy(p, names->base, names->base_len);
    p += names->base_len;
    *p++ = '/';
    p = hex_into(p, key, 1);
    *p++ = '/';
    p = hex_into(p, key + 1, 1);
    *p++ = '/';
    if (temp)
        *p++ = '.';
    p = hex_into(p, key, len);
    memcpy(p, SUFFIX, sizeof SUFFIX - 1);
    p += sizeof SUFFIX - 1;
    if (temp) {
        *p++ = '.';
        memcpy(p, names->token, names->token_len);
        p += names->token_len;
        memcpy(p, TEMP_SUFFIX, sizeof TEMP_SUFFIX - 1);
        p += sizeof TEMP_SUFFIX - 1;
    }
    *p = '\0';
}

/* fileformat.encode_header(fingerprint, key i, size, digest 0) into out (HEADER_SIZE) */
static void header_into(unsigned char *out, const Names *names, Py_ssize_t i, uint64_t size)
{
    size_t len = (size_t)(names->bounds[i + 1] - names->bounds[i]);
    memset(out, 0, HEADER_SIZE);
    memcpy(out, names->prefix, PREFIX_SIZE);
    put_le(out + LENGTH_OFFSET, size, 8);
    put_le(out + KEY_LEN_OFFSET, len, 2);
    memcpy(out + KEY_OFFSET, names->keys + names->bounds[i], len);
    put_le(out + KEY_OFFSET + len, crc32_of(out, KEY_OFFSET + len), 4);
}

/* ------------------------------------------------------------- resolution */

/* A block path is resolved beneath the volume root's fd, never through a symlink at any
 * level: a writer on the shared volume who swaps a fan-out directory (or the fingerprint
 * directory) for a symlink cannot make this pod read or write outside the volume. With
 * dirfd AT_FDCWD (tests, tools) the path is taken as given, still with no symlink on it.
 * openat2 (Linux 5.6+) does it in one call; elsewhere each level is opened in turn with
 * O_NOFOLLOW (a symlink there: ELOOP or ENOTDIR). */
struct kvtier_open_how {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};
#define KVTIER_RESOLVE_NO_MAGICLINKS 0x02
#define KVTIER_RESOLVE_NO_SYMLINKS 0x04
#define KVTIER_RESOLVE_BENEATH 0x08
#ifndef SYS_openat2
#define SYS_openat2 437 /* the same number on x86_64 and aarch64 */
#endif
#define DIR_FLAGS (O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)

static int openat2_missing; /* set once where the kernel has no openat2 (benign race) */

static int walk_open(int dirfd, const char *path, int flags, mode_t mode)
{
    char buf[4096];
    size_t len = strlen(path);
    if (len == 0 || len >= sizeof buf) {
        errno = len ? ENAMETOOLONG : ENOENT;
        return -1;
    }
    memcpy(buf, path, len + 1);
    char *name = buf;
    int at = dirfd;
    if (buf[0] == '/') {
        if (dirfd != AT_FDCWD) {
            errno = EXDEV;
            return -1;
        }
        at = open("/", DIR_FLAGS);
        if (at < 0)
            return -1;
        while (*name == '/')
            name++;
    }
    for (;;) {
        char *slash = strchr(name, '/');
        if (slash)
            *slash = '\0';
        if (strcmp(name, "..") == 0 || (slash && *name == '\0')) {
            if (at != dirfd)
                close(at);
            errno = EXDEV;
            return -1;
        }
        int fd = slash ? openat(at, name, DIR_FLAGS)
                       : openat(at, name, flags | O_NOFOLLOW, mode);
        int saved = errno;
        if (at != dirfd)
            close(at);
        if (fd < 0 || !slash) {
            errno = saved;
            return fd;
        }
        at = fd;
        name = slash + 1;
    }
}

static int open_below(int dirfd, const char *path, int flags, mode_t mode)
{
    if (!openat2_missing) {
        struct kvtier_open_how how = {
            (uint64_t)(flags | O_NOFOLLOW), (flags & O_CREAT) ? (uint64_t)mode : 0,
            KVTIER_RESOLVE_NO_SYMLINKS | KVTIER_RESOLVE_NO_MAGICLINKS
                | (dirfd == AT_FDCWD ? 0 : KVTIER_RESOLVE_BENEATH)};
        long fd = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
        if (fd >= 0 || errno != ENOSYS)
            return (int)fd;
        openat2_missing = 1;
    }
    return walk_open(dirfd, path, flags, mode);
}

/* The directory a path names the file in (O_PATH, resolved as above), and where the
 * file's own name starts in path. */
static int parent_below(int dirfd, char *path, const char **name)
{
    char *slash = strrchr(path, '/');
    if (!slash) {
        *name = path;
        return dirfd == AT_FDCWD ? open(".", DIR_FLAGS) : fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
    }
    *slash = '\0';
    int fd = open_below(dirfd, slash == path ? "/" : path, DIR_FLAGS, 0);
    *slash = '/';
    *name = slash + 1;
    return fd;
}

/* ------------------------------------------------------------- file I/O */

/* All of size bytes at offset, retrying short transfers and EINTR. */
static int transfer(int fd, unsigned char *at, size_t size, off_t offset, int write)
{
    size_t done = 0;
    while (done < size) {
        ssize_t n = write ? pwrite(fd, at + done, size - done, offset + (off_t)done)
                          : pread(fd, at + done, size - done, offset + (off_t)done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return 0;
        done += (size_t)n;
    }
    return 1;
}

/* The header and size payload bytes in one syscall (one device round trip per file with
 * O_DIRECT); a short transfer is finished piece by piece. */
static int header_and_payload(int fd, unsigned char *header, unsigned char *payload,
                              size_t size, int write)
{
    struct iovec iov[2] = {{header, HEADER_SIZE}, {payload, size}};
    ssize_t n;
    do {
        n = write ? pwritev(fd, iov, 2, 0) : preadv(fd, iov, 2, 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0)
        return 0;
    size_t got = (size_t)n;
    if (got < HEADER_SIZE)
        return transfer(fd, header + got, HEADER_SIZE - got, (off_t)got, write)
               && transfer(fd, payload, size, HEADER_SIZE, write);
    got -= HEADER_SIZE;
    return transfer(fd, payload + got, size - got, (off_t)(HEADER_SIZE + got), write);
}

/* A large payload piece by piece, each hashed while in cache (a store before writing
 * it, a load after reading it). A store writes the header, digest filled in, last; a
 * load reads it with the first piece. piece: a multiple of 4 KiB. */
static int in_pieces(int fd, unsigned char *header, unsigned char *payload, size_t size,
                     size_t piece, int write, uint64_t *digest)
{
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    if (!xxh3.reset(&state))
        return 0;
    if (!write && !header_and_payload(fd, header, payload, piece < size ? piece : size, 0))
        return 0;
    for (size_t done = 0; done < size;) {
        size_t n = size - done < piece ? size - done : piece;
        if (!write && done
            && !transfer(fd, payload + done, n, (off_t)(HEADER_SIZE + done), 0))
            return 0;
        if (!xxh3.update(&state, payload + done, n))
            return 0;
        if (write && !transfer(fd, payload + done, n, (off_t)(HEADER_SIZE + done), 1))
            return 0;
        done += n;
    }
    *digest = xxh3.digest(&state);
    if (write) {
        put_le(header + DIGEST_OFFSET, *digest, 8);
        return transfer(fd, header, HEADER_SIZE, 0, 1);
    }
    return 1;
}

static int64_t ns_of(struct timespec ts)
{
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef struct {
    Names names;
    int dirfd; /* paths are resolved beneath it (AT_FDCWD: as given) */
    Py_ssize_t count;
    const int64_t *addresses; /* where each payload is (the caller vouches) */
    const int64_t *sizes;
    unsigned char *headers; /* count * HEADER_SIZE */
    int flags;
    size_t piece;
    int64_t *status;
    double *elapsed;
    int64_t *last_used; /* loads only */
    int fsync;          /* stores only */
} Batch;

/* One attempt at a block of a load: DONE when a regular file with exactly the expected
 * header and a payload matching its digest was read into place. *stale: it failed with
 * ESTALE (a network filesystem's cached name for a file another node has replaced). */
static int64_t read_file(const Batch *b, Py_ssize_t i, const char *path, unsigned char *want,
                         int *stale)
{
    unsigned char *header = b->headers + (size_t)i * HEADER_SIZE;
    unsigned char *payload = (unsigned char *)(intptr_t)b->addresses[i];
    size_t size = (size_t)b->sizes[i];
    uint64_t digest = 0;
    struct stat st;

    *stale = 0;
    int fd = open_below(b->dirfd, path, b->flags, 0);
    if (fd < 0) {
        *stale = errno == ESTALE;
        return NOT_DONE;
    }
    /* Nothing but a regular file is read (the flags keep a FIFO from blocking the open,
     * a symlink from being followed); its times are taken on the way, from the open file
     * (by name would be one more round trip on a network filesystem). */
    int got = fstat(fd, &st) == 0;
    if (!got || !S_ISREG(st.st_mode)) {
        *stale = !got && errno == ESTALE;
        close(fd);
        return NOT_DONE;
    }
    int64_t atime = ns_of(st.st_atim), mtime = ns_of(st.st_mtim);
    b->last_used[i] = atime > mtime ? atime : mtime;
    int whole;
    errno = 0; /* a short file (EOF) sets none */
    if (b->piece > 0 && b->piece < size) {
        whole = in_pieces(fd, header, payload, size, b->piece, 0, &digest);
    } else {
        whole = header_and_payload(fd, header, payload, size, 0);
        if (whole)
            digest = xxh3.hash(payload, size);
    }
    *stale = !whole && errno == ESTALE;
    close(fd); /* read-only: nothing to lose on a failed close */
    if (!whole)
        return NOT_DONE;
    header_into(want, &b->names, i, size);
    /* every byte as expected but the digest, which must be the payload's */
    if (memcmp(header, want, DIGEST_OFFSET) != 0
        || memcmp(header + DIGEST_OFFSET + 8, want + DIGEST_OFFSET + 8,
                  HEADER_SIZE - DIGEST_OFFSET - 8) != 0
        || get_le64(header + DIGEST_OFFSET) != digest)
        return NOT_DONE;
    return DONE;
}

/* One block of a load, tried once more where the first try met ESTALE: on a network
 * filesystem (GlusterFS, NFS) a node's cached name can point for a while (GlusterFS: its
 * 1 s entry timeout) at the file another node has just replaced. A stat by name fails
 * there too and makes the kernel look the name up afresh (it retries a path lookup that
 * met ESTALE with revalidation); the second open then gets the new file. */
static int64_t read_one(const Batch *b, Py_ssize_t i, char *path, unsigned char *want)
{
    int stale;
    path_into(path, &b->names, i, 0);
    int64_t status = read_file(b, i, path, want, &stale);
    if (status == DONE || !stale)
        return status;
    struct stat st;
    if (fstatat(b->dirfd, path, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return NOT_DONE; /* gone meanwhile: a miss the Python path reports */
    b->last_used[i] = 0;
    return read_file(b, i, path, want, &stale);
}

/* Publish temp at final without replacing a block already there: RENAME_NOREPLACE where
 * the filesystem has it (local ones), else (*plain set: GlusterFS's FUSE client and NFS say
 * EINVAL) a plain rename, which may replace a block another writer published meanwhile;
 * that one has the same bytes (a key is a hash of its tokens under one fingerprint) and a
 * reader keeps the inode it opened, so only the rewrite is wasted. DONE, EXISTS (a
 * regular file had the final name: temp left for the caller to remove) or NOT_DONE. */
static int64_t publish(int dir, const char *temp, const char *final, int *plain)
{
    if (!*plain) {
        if (renameat2(dir, temp, dir, final, RENAME_NOREPLACE) == 0)
            return DONE;
        if (errno == EEXIST) {
            struct stat st;
            /* a regular file: another writer got there first; anything else (a
             * directory, FIFO, symlink): the Python path decides */
            if (fstatat(dir, final, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
                return EXISTS;
            return NOT_DONE;
        }
        if (errno != EINVAL && errno != ENOSYS)
            return NOT_DONE;
        *plain = 1; /* for the rest of the batch: the same filesystem */
    }
    return renameat(dir, temp, dir, final) == 0 ? DONE : NOT_DONE;
}

/* One block of a store: written to its temp name, closed and published under its final
 * name (publish). No existence check first: on a network filesystem that stat is one more
 * request per block, and a block already known to be there is not sent here (the store's
 * lookup cache; vLLM looks up before it stores). NOT_DONE and EXISTS leave no temp file. */
static int64_t write_one(const Batch *b, Py_ssize_t i, char *final, char *temp, int *plain)
{
    unsigned char *header = b->headers + (size_t)i * HEADER_SIZE;
    unsigned char *payload = (unsigned char *)(intptr_t)b->addresses[i];
    size_t size = (size_t)b->sizes[i];
    uint64_t digest = 0;

    path_into(final, &b->names, i, 0);
    header_into(header, &b->names, i, size);
    int pieces = b->piece > 0 && b->piece < size;
    if (!pieces)
        put_le(header + DIGEST_OFFSET, xxh3.hash(payload, size), 8);
    path_into(temp, &b->names, i, 1);
    /* Everything happens in the block's fan-out directory, reached without a symlink:
     * the temp file, the rename and the clean-up are relative to it. */
    const char *temp_name, *final_name;
    int dir = parent_below(b->dirfd, temp, &temp_name);
    if (dir < 0)
        return NOT_DONE;
    final_name = strrchr(final, '/') ? strrchr(final, '/') + 1 : final;
    int64_t status = NOT_DONE;
    int fd = openat(dir, temp_name, b->flags | O_NOFOLLOW, 0664);
    if (fd >= 0) {
        int ok = pieces ? in_pieces(fd, header, payload, size, b->piece, 1, &digest)
                        : header_and_payload(fd, header, payload, size, 1);
        if (ok && b->fsync)
            ok = fdatasync(fd) == 0;
        ok = close(fd) == 0 && ok; /* NFS reports ENOSPC at close */
        status = ok ? publish(dir, temp_name, final_name, plain) : NOT_DONE;
        if (status != DONE)
            unlinkat(dir, temp_name, 0);
    }
    close(dir);
    return status;
}

static void read_all(const Batch *b, char *path, unsigned char *want)
{
    for (Py_ssize_t i = 0; i < b->count; i++) {
        double began = now_seconds();
        b->last_used[i] = 0;
        b->status[i] = read_one(b, i, path, want);
        b->elapsed[i] = now_seconds() - began;
    }
}

static void write_all(const Batch *b, char *final, char *temp)
{
    int plain = 0;
    for (Py_ssize_t i = 0; i < b->count; i++) {
        double began = now_seconds();
        b->status[i] = write_one(b, i, final, temp, &plain);
        b->elapsed[i] = now_seconds() - began;
    }
}

/* ------------------------------------------------------------- arguments */

/* A buffer of exactly count items of itemsize bytes, aligned for them. */
static int check_array(const Py_buffer *view, Py_ssize_t count, Py_ssize_t itemsize,
                       const char *what)
{
    if (view->len != count * itemsize || ((uintptr_t)view->buf % (uintptr_t)itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd aligned items of %zd bytes expected", what,
                     count, itemsize);
        return 0;
    }
    return 1;
}

static int check_name(const Py_buffer *view, const char *what, int slash_ok)
{
    const char *p = view->buf;
    for (Py_ssize_t i = 0; i < view->len; i++) {
        if (p[i] == '\0' || (!slash_ok && p[i] == '/')) {
            PyErr_Format(PyExc_ValueError, "%s holds a NUL byte%s", what,
                         slash_ok ? "" : " or a slash");
            return 0;
        }
    }
    return 1;
}

/* Everything a batch needs besides its outputs, checked so that no index or length in
 * the loop can leave its buffer. */
static int check_names(Names *names, Py_buffer *base, Py_buffer *prefix, Py_buffer *keys,
                       Py_buffer *bounds, Py_ssize_t count)
{
    if (!check_name(base, "base", 1) || !check_array(bounds, count + 1, 8, "bounds"))
        return 0;
    if (prefix->len != PREFIX_SIZE) {
        PyErr_Format(PyExc_ValueError, "prefix must be %d bytes", PREFIX_SIZE);
        return 0;
    }
    const int64_t *at = bounds->buf;
    if (at[0] != 0 || at[count] != keys->len) {
        PyErr_SetString(PyExc_ValueError, "bounds do not cover the keys");
        return 0;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t len = at[i + 1] - at[i];
        if (len < MIN_KEY_BYTES || len > MAX_KEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "a key must be %d to %d bytes", MIN_KEY_BYTES,
                         MAX_KEY_BYTES);
            return 0;
        }
    }
    names->base = base->buf;
    names->base_len = (size_t)base->len;
    names->prefix = prefix->buf;
    names->keys = keys->buf;
    names->bounds = at;
    names->token = NULL;
    names->token_len = 0;
    return 1;
}

static int check_payloads(Batch *b, Py_buffer *addresses, Py_buffer *sizes,
                          Py_buffer *headers, long long piece)
{
    if (!check_array(addresses, b->count, 8, "addresses")
        || !check_array(sizes, b->count, 8, "sizes"))
        return 0;
    if (headers->len < b->count * HEADER_SIZE) {
        PyErr_SetString(PyExc_ValueError, "headers: 4096 bytes per block expected");
        return 0;
    }
    if (piece < 0 || piece % HEADER_SIZE) {
        PyErr_Format(PyExc_ValueError, "piece must be 0 or a multiple of 4096, not %lld",
                     piece);
        return 0;
    }
    const int64_t *size = sizes->buf;
    for (Py_ssize_t i = 0; i < b->count; i++) {
        if (size[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "a negative size");
            return 0;
        }
    }
    b->addresses = addresses->buf;
    b->sizes = size;
    b->headers = headers->buf;
    b->piece = (size_t)piece;
    return 1;
}

static void release(Py_buffer *views, int count)
{
    for (int i = 0; i < count; i++)
        if (views[i].obj)
            PyBuffer_Release(&views[i]);
}

PyDoc_STRVAR(read_batch_doc,
    "read_batch(dirfd, base, prefix, keys, bounds, addresses, sizes, headers, flags,\n"
    "           piece, status, last_used, elapsed)\n\n"
    "Load a batch of block files (see batchio.read_blocks); the GIL is released.");

static PyObject *read_batch(PyObject *self, PyObject *args)
{
    (void)self;
    enum { BASE, PREFIX, KEYS, BOUNDS, ADDRESSES, SIZES, HEADERS, STATUS, LAST, ELAPSED, N };
    Py_buffer v[N];
    memset(v, 0, sizeof v);
    int dirfd, flags;
    long long piece;
    if (!PyArg_ParseTuple(args, "iy*y*y*y*y*y*w*iLw*w*w*", &dirfd, &v[BASE], &v[PREFIX],
                          &v[KEYS], &v[BOUNDS], &v[ADDRESSES], &v[SIZES], &v[HEADERS], &flags,
                          &piece, &v[STATUS], &v[LAST], &v[ELAPSED]))
        return NULL;
    Batch b;
    memset(&b, 0, sizeof b);
    b.dirfd = dirfd;
    b.count = v[ADDRESSES].len / 8;
    b.flags = flags;
    PyObject *result = NULL;
    char *path = NULL;
    unsigned char *want = NULL;
    if (!check_names(&b.names, &v[BASE], &v[PREFIX], &v[KEYS], &v[BOUNDS], b.count)
        || !check_payloads(&b, &v[ADDRESSES], &v[SIZES], &v[HEADERS], piece)
        || !check_array(&v[STATUS], b.count, 8, "status")
        || !check_array(&v[LAST], b.count, 8, "last_used")
        || !check_array(&v[ELAPSED], b.count, 8, "elapsed"))
        goto done;
    b.status = v[STATUS].buf;
    b.last_used = v[LAST].buf;
    b.elapsed = v[ELAPSED].buf;
    path = PyMem_Malloc(path_capacity(&b.names));
    want = PyMem_Malloc(HEADER_SIZE);
    if (!path || !want) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    read_all(&b, path, want);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(path);
    PyMem_Free(want);
    release(v, N);
    return result;
}

PyDoc_STRVAR(write_batch_doc,
    "write_batch(dirfd, base, prefix, keys, bounds, token, addresses, sizes, headers,\n"
    "            flags, fsync, piece, status, elapsed)\n\n"
    "Store a batch of block files (see batchio.write_blocks); the GIL is released.");

static PyObject *write_batch(PyObject *self, PyObject *args)
{
    (void)self;
    enum { BASE, PREFIX, KEYS, BOUNDS, TOKEN, ADDRESSES, SIZES, HEADERS, STATUS, ELAPSED, N };
    Py_buffer v[N];
    memset(v, 0, sizeof v);
    int dirfd, flags, fsync;
    long long piece;
    if (!PyArg_ParseTuple(args, "iy*y*y*y*y*y*y*w*ipLw*w*", &dirfd, &v[BASE], &v[PREFIX],
                          &v[KEYS], &v[BOUNDS], &v[TOKEN], &v[ADDRESSES], &v[SIZES],
                          &v[HEADERS], &flags, &fsync, &piece, &v[STATUS], &v[ELAPSED]))
        return NULL;
    Batch b;
    memset(&b, 0, sizeof b);
    b.dirfd = dirfd;
    b.count = v[ADDRESSES].len / 8;
    b.flags = flags;
    b.fsync = fsync;
    PyObject *result = NULL;
    char *final = NULL, *temp = NULL;
    if (!check_names(&b.names, &v[BASE], &v[PREFIX], &v[KEYS], &v[BOUNDS], b.count)
        || !check_payloads(&b, &v[ADDRESSES], &v[SIZES], &v[HEADERS], piece)
        || !check_array(&v[STATUS], b.count, 8, "status")
        || !check_array(&v[ELAPSED], b.count, 8, "elapsed"))
        goto done;
    if (v[TOKEN].len == 0 || !check_name(&v[TOKEN], "token", 0)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a store needs a token for its temp names");
        goto done;
    }
    b.names.token = v[TOKEN].buf;
    b.names.token_len = (size_t)v[TOKEN].len;
    b.status = v[STATUS].buf;
    b.elapsed = v[ELAPSED].buf;
    final = PyMem_Malloc(path_capacity(&b.names));
    temp = PyMem_Malloc(path_capacity(&b.names));
    if (!final || !temp) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    write_all(&b, final, temp);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(final);
    PyMem_Free(temp);
    release(v, N);
    return result;
}

PyDoc_STRVAR(built_doc,
    "built(base, prefix, key, token, size) -> (path, header)\n\n"
    "The path (a temp name, given a non-empty token) and header (digest 0) the batch\n"
    "functions build for one block: to hold them to Layout and fileformat.");

static PyObject *built(PyObject *self, PyObject *args)
{
    (void)self;
    enum { BASE, PREFIX, KEY, TOKEN, N };
    Py_buffer v[N];
    memset(v, 0, sizeof v);
    long long size;
    if (!PyArg_ParseTuple(args, "y*y*y*y*L", &v[BASE], &v[PREFIX], &v[KEY], &v[TOKEN], &size))
        return NULL;
    PyObject *result = NULL;
    char *path = NULL;
    int64_t bounds[2] = {0, v[KEY].len};
    Py_buffer bounds_view;
    memset(&bounds_view, 0, sizeof bounds_view);
    bounds_view.buf = bounds;
    bounds_view.len = sizeof bounds;
    Names names;
    unsigned char header[HEADER_SIZE];
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative size");
        goto done;
    }
    if (!check_names(&names, &v[BASE], &v[PREFIX], &v[KEY], &bounds_view, 1)
        || !check_name(&v[TOKEN], "token", 0))
        goto done;
    names.token = v[TOKEN].buf;
    names.token_len = (size_t)v[TOKEN].len;
    path = PyMem_Malloc(path_capacity(&names));
    if (!path) {
        PyErr_NoMemory();
        goto done;
    }
    path_into(path, &names, 0, v[TOKEN].len > 0);
    header_into(header, &names, 0, (uint64_t)size);
    result = Py_BuildValue("(y#y#)", path, (Py_ssize_t)strlen(path), (const char *)header,
                           (Py_ssize_t)HEADER_SIZE);
done:
    PyMem_Free(path);
    release(v, N);
    return result;
}

PyDoc_STRVAR(open_beneath_doc,
    "open_beneath(dirfd, path, flags, mode) -> int\n\n"
    "os.open(path, flags, mode, dir_fd=dirfd) resolved beneath dirfd without following a\n"
    "symlink at any level (openat2 RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS, or a walk with\n"
    "O_NOFOLLOW); dirfd -100 (AT_FDCWD): the path as given, no symlink on it. OSError.");

static PyObject *open_beneath(PyObject *self, PyObject *args)
{
    (void)self;
    int dirfd, flags, mode;
    Py_buffer path;
    if (!PyArg_ParseTuple(args, "iy*ii", &dirfd, &path, &flags, &mode))
        return NULL;
    PyObject *result = NULL;
    char *copy = NULL;
    if (!check_name(&path, "path", 1))
        goto done;
    copy = PyMem_Malloc((size_t)path.len + 1);
    if (!copy) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(copy, path.buf, (size_t)path.len);
    copy[path.len] = '\0';
    int fd;
    Py_BEGIN_ALLOW_THREADS
    fd = open_below(dirfd, copy, flags, (mode_t)mode);
    Py_END_ALLOW_THREADS
    if (fd < 0)
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, copy);
    else
        result = PyLong_FromLong(fd);
done:
    PyMem_Free(copy);
    PyBuffer_Release(&path);
    return result;
}

PyDoc_STRVAR(digest_doc,
    "digest(buffer) -> int\n\nXXH3-64 (seed 0) of a buffer's bytes; the GIL is released "
    "for large ones.");

static PyObject *digest(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    XXH64_hash_t h;
    if (view.len >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        h = xxh3.hash(view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        h = xxh3.hash(view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(address_doc, "address(buffer) -> int\n\nWhere a contiguous buffer's bytes "
                          "start (0 when empty).");

static PyObject *address(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    uintptr_t at = view.len ? (uintptr_t)view.buf : 0;
    PyBuffer_Release(&view);
    return PyLong_FromSize_t((size_t)at);
}

static PyMethodDef methods[] = {
    {"read_batch", read_batch, METH_VARARGS, read_batch_doc},
    {"write_batch", write_batch, METH_VARARGS, write_batch_doc},
    {"built", built, METH_VARARGS, built_doc},
    {"open_beneath", open_beneath, METH_VARARGS, open_beneath_doc},
    {"digest", digest, METH_O, digest_doc},
    {"address", address, METH_O, address_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier_offload._native",
    "The offload backend's batch I/O and XXH3-64 digest (see batchio.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    crc_init();
    kvtier_xxh3_avx2(&xxh3);
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddIntConstant(m, "FORMAT_VERSION", FORMAT_VERSION)
        || PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE)
        || PyModule_AddIntConstant(m, "LENGTH_OFFSET", LENGTH_OFFSET)
        || PyModule_AddIntConstant(m, "DIGEST_OFFSET", DIGEST_OFFSET)
        || PyModule_AddIntConstant(m, "KEY_LEN_OFFSET", KEY_LEN_OFFSET)
        || PyModule_AddIntConstant(m, "KEY_OFFSET", KEY_OFFSET)
        || PyModule_AddIntConstant(m, "MIN_KEY_BYTES", MIN_KEY_BYTES)
        || PyModule_AddIntConstant(m, "MAX_KEY_BYTES", MAX_KEY_BYTES)
        || PyModule_AddIntConstant(m, "DONE", DONE)
        || PyModule_AddIntConstant(m, "NOT_DONE", NOT_DONE)
        || PyModule_AddIntConstant(m, "EXISTS", EXISTS)
        || PyModule_AddIntConstant(m, "BATCH_API", BATCH_API)
        || PyModule_AddIntConstant(m, "XXHASH_VERSION", XXH_versionNumber())
        || PyModule_AddStringConstant(m, "XXH3_BUILD", xxh3.name)
        || PyModule_AddStringConstant(m, "SUFFIX", SUFFIX)
        || PyModule_AddStringConstant(m, "TEMP_SUFFIX", TEMP_SUFFIX)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
