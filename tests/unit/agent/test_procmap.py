"""Which container a GPU process belongs to: its cgroup line, and the pod directory's evidence."""

from __future__ import annotations

from deviceplugin.agent.procmap import cgroup_owner


def test_cgroup_parsing(tmp_path):
    uid, cid = "0f8b4b9e-9d6c-4a7e-8c1a-2b3c4d5e6f70", "a" * 64
    forms = {
        1: f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
        f"/cri-containerd-{cid}.scope\n",
        2: f"12:memory:/kubepods/burstable/pod{uid}/{cid}\n11:cpu:/kubepods/burstable/pod{uid}/{cid}\n",
        3: "0::/system.slice/nvidia-persistenced.service\n",
    }
    for pid, text in forms.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    assert cgroup_owner(1, tmp_path) == (uid, cid) and cgroup_owner(2, tmp_path) == (uid, cid)
    assert cgroup_owner(3, tmp_path) is None and cgroup_owner(99, tmp_path) is None


def test_process_owner_evidence(tmp_path):
    from deviceplugin.agent.procmap import ProcessMapper
    from deviceplugin.model.pods import PodRef

    uid, running, restarted = "0f8b4b9e-9d6c-4a7e-8c1a-2b3c4d5e6f70", "a" * 64, "b" * 64
    gone_uid = "1f8b4b9e-9d6c-4a7e-8c1a-2b3c4d5e6f70"
    for pid, (pod_uid, cid) in {
        1: (uid, running),
        2: (uid, restarted),
        3: (uid, "c" * 64),
        4: (gone_uid, "d" * 64),
    }.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(f"0::/kubepods/pod{pod_uid}/{cid}\n")

    class Directory:
        def pods(self):
            return [
                PodRef(uid=uid, namespace="ml", name="p", containers={running: "app"}, ended=frozenset({restarted}))
            ]

    mapper = ProcessMapper(Directory(), tmp_path)
    mapper.refresh()
    assert mapper.owner(1).key == ("ml", "p", "app")
    assert "has ended" in mapper.owner(2).ended  # an earlier instance of a restarted container
    assert "not (yet) in the status" in mapper.owner(3).unknown and not mapper.owner(3).ended
    assert "no longer exists" in mapper.owner(4).ended
    assert "--proc-root is not the host's /proc" in mapper.owner(99).unknown
