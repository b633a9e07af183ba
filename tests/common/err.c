/*
 * common_err: the messages cm_err and cm_err_errno hand the caller.
 *  - a message longer than any fixed buffer (a 4,000-byte path in it) comes back whole;
 *  - cm_err_errno appends strerror of the errno it was called with, and leaves errno as it was;
 *  - a message may quote the one it replaces (cm_err(&e, ..., "%s", e)): it is read before it
 *    is freed;
 *  - a NULL errptr takes nothing and the code still comes back.
 */
#include <errno.h>
#include <string.h>

#include "check.h"
#include "common/common.h"

int main(void)
{
    char path[4001];
    memset(path, 'p', sizeof path - 1);
    path[sizeof path - 1] = '\0';
    char *e = NULL;
    CHECK(cm_err(&e, CM_EINVAL, "cannot open %s here", path) == CM_EINVAL);
    CHECK_MSG(e != NULL && strlen(e) == strlen("cannot open  here") + 4000,
              "a long message came back as %zu bytes", e ? strlen(e) : 0);
    CHECK(e != NULL && strncmp(e, "cannot open ppp", 15) == 0 && strcmp(e + 4012, " here") == 0);

    errno = ENOENT;
    CHECK(cm_err_errno(&e, CM_ENOTFOUND, "file %s", path) == CM_ENOTFOUND);
    CHECK(errno == ENOENT);
    const char *want = ": No such file or directory";
    CHECK_MSG(e != NULL && strlen(e) == 5 + 4000 + strlen(want) && strcmp(e + 5 + 4000, want) == 0,
              "cm_err_errno gave %zu bytes", e ? strlen(e) : 0);

    CHECK(cm_err(&e, CM_ECORRUPT, "outer: %s", e) == CM_ECORRUPT);
    CHECK_MSG(e != NULL && strncmp(e, "outer: file ppp", 15) == 0 &&
                  strlen(e) == 7 + 5 + 4000 + strlen(want),
              "a message quoting the one it replaced: %.40s", e ? e : "(none)");
    free(e);

    CHECK(cm_err(NULL, CM_EINVAL, "nobody reads %s", path) == CM_EINVAL);
    return check_done();
}
