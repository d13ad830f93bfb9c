/* privprobe: what privilege a process holds, for the container hardening tests.
 * Built static by scripts/build-test-images.sh and installed setuid-root (mode 4755, owner 0)
 * in the test image gpufleet/privprobe:1, so that running it shows whether a setuid-root
 * binary of the job's own image can gain anything. Prints key=value lines:
 *   ruid, euid, setuid0 (result of setuid(0)), nnp (NoNewPrivs), capeff (CapEff hex),
 *   af_packet, raw_inet (ok / the errno name), and with a directory argument DIR:
 *   plant_chown, plant_chmod (chown DIR/planted to 0:0, chmod 04755), plant_uid, plant_mode.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if_ether.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *res(int rc) { return rc == 0 ? "ok" : strerrorname_np(errno); }

static void status_field(const char *key, const char *name) {
    char line[256];
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) { printf("%s=?\n", key); return; }
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, name, strlen(name)) == 0) {
            char *v = line + strlen(name);
            while (*v == ' ' || *v == '\t') v++;
            v[strcspn(v, "\n")] = 0;
            printf("%s=%s\n", key, v);
        }
    }
    fclose(f);
}

int main(int argc, char **argv) {
    printf("ruid=%d\neuid=%d\n", (int)getuid(), (int)geteuid());
    status_field("nnp", "NoNewPrivs:");
    status_field("capeff", "CapEff:");
    status_field("capbnd", "CapBnd:");
    int s = socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL));
    printf("af_packet=%s\n", res(s < 0 ? -1 : 0));
    if (s >= 0) close(s);
    s = socket(AF_INET, SOCK_RAW, IPPROTO_ICMP);
    printf("raw_inet=%s\n", res(s < 0 ? -1 : 0));
    if (s >= 0) close(s);
    printf("setuid0=%s\n", res(setuid(0)));
    printf("euid_after=%d\n", (int)geteuid());
    if (argc > 1) {
        char path[4096];
        snprintf(path, sizeof path, "%s/planted", argv[1]);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0755);
        if (fd < 0) { printf("plant_open=%s\n", strerrorname_np(errno)); return 0; }
        close(fd);
        printf("plant_chown=%s\n", res(chown(path, 0, 0)));
        printf("plant_chmod=%s\n", res(chmod(path, 04755)));
        struct stat st;
        if (stat(path, &st) == 0) printf("plant_uid=%d\nplant_mode=%o\n", (int)st.st_uid, st.st_mode & 07777);
    }
    return 0;
}
