// Workgroup-wide reductions through subgroup operations (prepended, before
// the kernel file, to attention.wgsl and moe.wgsl): each subgroup's result
// goes to `red`, then every invocation folds them. `red` is free for other
// use between calls.

var<workgroup> red: array<f32, 256>;

// The max and the sum of v over the workgroup (two barriers each).
fn reduce_max(v: f32, sg: u32, nsg: u32, lane: u32) -> f32 {
    let s = subgroupMax(v);
    if (lane == 0u) {
        red[sg] = s;
    }
    workgroupBarrier();
    var r = red[0];
    for (var i = 1u; i < nsg; i++) {
        r = max(r, red[i]);
    }
    workgroupBarrier();
    return r;
}

fn reduce_sum(v: f32, sg: u32, nsg: u32, lane: u32) -> f32 {
    let s = subgroupAdd(v);
    if (lane == 0u) {
        red[sg] = s;
    }
    workgroupBarrier();
    var r = red[0];
    for (var i = 1u; i < nsg; i++) {
        r += red[i];
    }
    workgroupBarrier();
    return r;
}
