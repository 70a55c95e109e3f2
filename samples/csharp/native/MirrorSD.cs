// P/Invoke bindings for libmirrorsd (runtime/native/include/mirrorsd.h) and a small managed wrapper.
// C# 7 only (no records, no `using var`, no nullable annotations), so it compiles with Mono's mcs and a .NET SDK alike.
using System;
using System.Collections.Generic;
using System.Runtime.InteropServices;

namespace MirrorSD
{
    public enum Mode { Ar = 0, Sd = 1, Mirror = 2 }

    public enum BranchBudget { Time = 0, Cap = 1 }

    [StructLayout(LayoutKind.Sequential)]
    public struct OpenOptions
    {
        public uint StructSize;
        [MarshalAs(UnmanagedType.LPStr)] public string TargetDevice;   // null = auto
        [MarshalAs(UnmanagedType.LPStr)] public string DraftDevice;
        public int TargetThreads;                                      // 0 = cores / 2
        public int DraftThreads;
        [MarshalAs(UnmanagedType.LPStr)] public string OpenVinoEpLibrary;
        [MarshalAs(UnmanagedType.LPStr)] public string KernelsLibrary;  // libmirrorsd_kern.so; null = ONNX Runtime's
    }

    [StructLayout(LayoutKind.Sequential)]
    public struct GenerateConfig
    {
        public uint StructSize;
        public int Mode;
        public int MaxNewTokens;
        public int Gamma;
        public int Branches;
        public int BranchBatch;
        public int RunnerUpK;
        public int BranchBudget;
        public int ExitHead;
        public int OnDraftFailure;  // 0 raise, 1 fallback
        public double DraftTimeoutS;
    }

    [StructLayout(LayoutKind.Sequential)]
    public struct Stats
    {
        public uint StructSize;
        public int Mode;
        public int FinishReason;
        public int Reserved;
        public long PromptTokens, NewTokens, Steps, Drafted, Accepted, Windows, Reused, Fallbacks, DraftForwards;
        public long BranchesRolledOut, DraftFailures;
        public double Seconds, TimeToFirstTokenS, TokensPerSecond, DecodeTokensPerSecond, MeanAcceptedTokens;
        public double AcceptanceRate, ReuseRate, TargetBusyS, DraftBusyS, DraftHiddenS, OverlapRatio;
    }

    [StructLayout(LayoutKind.Sequential, CharSet = CharSet.Ansi)]
    public struct ModelInfo
    {
        public uint StructSize;
        public int EosCount;
        public long VocabSize, ContextLimit, TargetLayers, ExitLayer, DraftLayers, TopK;
        [MarshalAs(UnmanagedType.ByValArray, SizeConst = 8)] public long[] EosTokenIds;
        [MarshalAs(UnmanagedType.ByValTStr, SizeConst = 64)] public string TargetProvider;
        [MarshalAs(UnmanagedType.ByValTStr, SizeConst = 64)] public string DraftProvider;
        [MarshalAs(UnmanagedType.ByValTStr, SizeConst = 16)] public string TargetKernels;  // "mirrorsd" or "ort"
        [MarshalAs(UnmanagedType.ByValTStr, SizeConst = 16)] public string DraftKernels;
    }

    [UnmanagedFunctionPointer(CallingConvention.Cdecl)]
    public delegate int TokenCallback(long token, IntPtr userData);

    public static class Native
    {
        const string Library = "mirrorsd";  // libmirrorsd.so, found through LD_LIBRARY_PATH or beside the program

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern IntPtr mirrorsd_last_error();  // owned by the library: never freed here

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern void mirrorsd_open_options_init(ref OpenOptions options);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern void mirrorsd_generate_config_init(ref GenerateConfig config);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern int mirrorsd_open([MarshalAs(UnmanagedType.LPStr)] string folder, ref OpenOptions options,
                                               out IntPtr model);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern int mirrorsd_model_get_info(IntPtr model, ref ModelInfo info);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern int mirrorsd_generate(IntPtr model, long[] prompt, int promptLength,
                                                   ref GenerateConfig config, TokenCallback onToken, IntPtr userData,
                                                   ref Stats stats);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern int mirrorsd_close(IntPtr model);  // a status since ABI 3 (8 = busy)

        public static string LastError()
        {
            return Marshal.PtrToStringAnsi(mirrorsd_last_error()) ?? "";
        }
    }

    public class MirrorSDException : Exception
    {
        public int Status { get; private set; }

        public MirrorSDException(int status, string message) : base(message)
        {
            Status = status;
        }
    }

    public sealed class Model : IDisposable
    {
        IntPtr handle;

        public ModelInfo Info { get; private set; }

        public Model(string folder, string targetDevice = null, string draftDevice = null, int threads = 0,
                     string kernelsLibrary = null)
        {
            var options = new OpenOptions();
            Native.mirrorsd_open_options_init(ref options);
            options.TargetDevice = targetDevice;
            options.DraftDevice = draftDevice;
            options.TargetThreads = threads;
            options.DraftThreads = threads;
            options.KernelsLibrary = kernelsLibrary;
            Check(Native.mirrorsd_open(folder, ref options, out handle));
            var info = new ModelInfo { StructSize = (uint)Marshal.SizeOf(typeof(ModelInfo)) };
            Check(Native.mirrorsd_model_get_info(handle, ref info));
            Info = info;
        }

        public static GenerateConfig DefaultConfig()
        {
            var config = new GenerateConfig();
            Native.mirrorsd_generate_config_init(ref config);
            return config;
        }

        // Greedy generation; onToken (may be null) sees each token as soon as it is committed.
        public List<long> Generate(long[] prompt, GenerateConfig config, out Stats stats, Action<long> onToken = null)
        {
            if (handle == IntPtr.Zero) throw new ObjectDisposedException("Model");
            var tokens = new List<long>();
            TokenCallback callback = (token, user) =>
            {
                tokens.Add(token);
                if (onToken != null) onToken(token);
                return 0;
            };
            stats = new Stats { StructSize = (uint)Marshal.SizeOf(typeof(Stats)) };
            int status = Native.mirrorsd_generate(handle, prompt, prompt.Length, ref config, callback, IntPtr.Zero,
                                                  ref stats);
            GC.KeepAlive(callback);  // the delegate must live until the native call returns
            Check(status);
            return tokens;
        }

        static void Check(int status)
        {
            if (status != 0) throw new MirrorSDException(status, Native.LastError());
        }

        public void Dispose()
        {
            if (handle != IntPtr.Zero)
            {
                Check(Native.mirrorsd_close(handle));  // busy (generating on another thread): the model stays open
                handle = IntPtr.Zero;
            }
        }
    }
}
